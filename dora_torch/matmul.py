"""GEMMs with fp32 results from low-precision inputs (cuBLAS accumulates in fp32 anyway)."""

from __future__ import annotations

import torch

_COMPUTE = {dt: torch.promote_types(dt, torch.float32) for dt in
            (torch.float16, torch.bfloat16, torch.float32, torch.float64)}  # fmt: skip


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms, compositions and reductions run in: promote(fp32, dtype) — fp32 for
    fp16, bf16 and fp32 inputs, float64 for float64 (docs/design.md §5). (A table lookup for
    the float dtypes: this is asked several times per layer call.)"""
    found = _COMPUTE.get(dtype)
    return torch.promote_types(dtype, torch.float32) if found is None else found


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: the same tensor when it already is (no dispatcher call on the hot
    path), else a cast."""
    return t if t.dtype == dtype else t.to(dtype)


def mm_out(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` returned in ``dtype``, with fp32 accumulation.

    a, b: 2-D in the same (activation) dtype. When ``dtype`` is fp32 and the inputs are
    bf16/fp16 on CUDA, cuBLAS writes the fp32 accumulator directly (``out_dtype``), so the
    result is not rounded to 16 bits on the way; elsewhere the product is cast.
    """
    if a.dtype == dtype:
        return torch.mm(a, b)
    if dtype == torch.float32 and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # torch without mm.dtype
            pass
    return torch.mm(a, b).to(dtype)


_UNUSED: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _unused_input(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor of ``dtype`` on ``device`` for ``addmm``'s ignored input (beta = 0), one
    per dtype and device, never written: allocating one per call cost host time."""
    key = (dtype, device)
    t = _UNUSED.get(key)
    if t is None:
        t = _UNUSED[key] = torch.empty((), dtype=dtype, device=device)
    return t


def _scaled_mm_impl(
    a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype, unused: torch.Tensor
):
    """The body of ``scaled_mm``, eager and inside the op compiled graphs call; ``unused``: a
    0-d tensor of ``dtype`` for addmm's ignored input (addmm broadcasts its input, so the
    plain form takes it as it is, with no Python ``expand`` per call)."""
    if dtype == a.dtype:
        return torch.addmm(unused, a, b, beta=0, alpha=alpha)
    if dtype == torch.float32 and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        # 2-D here: the out_dtype overload has not been run with a 0-d input on a GPU
        unused = unused.expand(a.shape[0], b.shape[1])
        try:
            return torch.addmm(unused, a, b, beta=0, alpha=alpha, out_dtype=dtype)
        except (TypeError, RuntimeError, NotImplementedError):  # torch without addmm.dtype
            pass
    out = mm_out(a, b, compute_dtype(a.dtype))
    if alpha != 1.0:
        out = out.mul_(alpha)
    return out if out.dtype == dtype else out.to(dtype)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """``alpha · (a @ b)`` returned in ``dtype``: one GEMM, fp32 accumulation, one rounding.

    a, b: 2-D in the same (activation) dtype; ``dtype`` is a's or, for 16-bit inputs on CUDA,
    fp32 (PEFT's fp32 adapters). cuBLAS applies alpha to the accumulator (``addmm`` with
    beta = 0, whose input is ignored, so an uninitialised 0-d tensor serves), instead of a
    product, a scaling pass and a cast; other dtypes and devices take that unfused form.
    Compiled graphs call the same code as one opaque op (``dora_torch::scaled_mm``): traced,
    it became an fp32 GEMM and an Inductor scale-and-cast kernel, an extra launch and an fp32
    [r, d_in] or [d_out, r] round trip per adapter gradient."""
    if torch.compiler.is_compiling():
        return _scaled_mm(a, b, alpha, dtype)
    return _scaled_mm_impl(a, b, alpha, dtype, _unused_input(dtype, a.device))


# Ops for compiled graphs, defined with the low-level ``torch.library.Library`` rather than
# ``torch.library.custom_op``: the latter's Python wrapper costs ~20 µs of host time per call
# against ~5 µs here (benchmarks/NOTES.md, session 12), paid per adapted layer and step in a
# compiled backward that is not CUDA-graphed.
_LIB = torch.library.Library("dora_torch", "DEF")
_LIB.define("addmm_into(Tensor(a!) out, Tensor a, Tensor b, float alpha) -> ()")


def _addmm_into_impl(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    out.addmm_(a, b, alpha=alpha)


def _addmm_into_fake(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    return None


_LIB.impl("addmm_into", _addmm_into_impl, "CompositeExplicitAutograd")
torch.library.register_fake("dora_torch::addmm_into", _addmm_into_fake, lib=_LIB)
_addmm_into = torch.ops.dora_torch.addmm_into.default

_LIB.define("scaled_mm(Tensor a, Tensor b, float alpha, ScalarType dtype) -> Tensor")


def _scaled_mm_fake(a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)


def _scaled_mm_op(a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype):
    """The op's body in compiled graphs: the eager one, with an ignored input of its own per
    call. The eager path's cached one would be allocated by the first compiled call, inside
    a CUDA graph tree's memory pool under mode="reduce-overhead", and outlive that graph,
    which the tree refuses ("tensor(s) in the cudagraph pool not tracked as outputs")."""
    return _scaled_mm_impl(a, b, alpha, dtype, a.new_empty((), dtype=dtype))


_LIB.impl("scaled_mm", _scaled_mm_op, "CompositeExplicitAutograd")
torch.library.register_fake("dora_torch::scaled_mm", _scaled_mm_fake, lib=_LIB)
_scaled_mm = torch.ops.dora_torch.scaled_mm.default


def addmm_inplace(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float):
    """``out += alpha · (a @ b)`` in place (cuBLAS with beta = 1), returning ``out``.

    Compiled graphs get the same in-place GEMM through a mutating custom op: functionalization
    turns ``out.addmm_`` into an out-of-place ``addmm``, which ATen runs as a copy of ``out``
    followed by the GEMM (one extra pass over a [T, d_in] gradient per layer), while Inductor
    runs a mutating custom op in place on a buffer nothing else reads."""
    if torch.compiler.is_compiling():
        _addmm_into(out, a, b, alpha)
        return out
    return out.addmm_(a, b, alpha=alpha)
