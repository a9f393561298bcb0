"""The factored DoRA norm (docs/design.md §2): never builds B·A.

    n_i² = ‖W_i‖² + 2s·Σ_j B_ij U_ij + s²·Σ_jk B_ij G_jk B_ik,   U = W Aᵀ, G = A Aᵀ

All intermediates are O(d_out·r + r²), in the compute dtype promote(fp32, W's dtype) (fp32;
float64 for a float64 W); without a gradient U is formed for ``config.norm_row_chunk(r)`` rows
at a time. ``‖W‖²`` is the frozen part (callers cache it). Precision rule, the same in both
backends (docs/design.md §5): A is rounded to W's dtype (it meets W in the U GEMM, and G is
formed from the same rounded A, with fp32 accumulation); B enters the assembly at the compute
precision. The assembly is one Triton kernel (fused tier) or a few torch ops (eager tier).

``factored_norm`` is differentiable in lora_A and lora_B with the exact, cheap gradient
(docs/design.md §2), which is how ``exact_norm_grad=True`` is implemented: with
c = (dL/dn) / n,

    dB = c ⊙_rows (s·U + s²·B G),   dA = s·(c ⊙_rows B)ᵀ W + s²·(Bᵀ diag(c) B) A"""

from __future__ import annotations

import torch

from . import checks, config
from .kernels.norm_pass import norm_pass, norm_pass_applies
from .matmul import compute_dtype, mm_out


def chunk_slices(size: int, chunk: int | None) -> list[slice]:
    """Slices covering range(size) in steps of ``chunk`` (one slice when None): the one
    chunking helper of dora_torch (columns of d_in, rows of d_out)."""
    step = size if chunk is None else chunk
    return [slice(i, min(i + step, size)) for i in range(0, max(size, 1), max(step, 1))]


def _sum(terms):
    """Sum of tensors without Python's ``0 +`` (an extra kernel launch for one term)."""
    it = iter(terms)
    total = next(it)
    for term in it:
        total = total + term
    return total


def _lowp(weight: torch.Tensor) -> bool:
    return weight.dtype in (torch.bfloat16, torch.float16)


def _fast_lowp(weight: torch.Tensor) -> bool:
    return weight.is_cuda and _lowp(weight)


def rounded_a(lora_A: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A as the norm uses it (docs/design.md §5): detached and rounded to W's dtype."""
    a = lora_A.detach()
    return a if a.dtype == weight.dtype else a.to(weight.dtype)


@torch.no_grad()
def base_sq_norm(weight: torch.Tensor, *, chunk_size: int | None = None) -> torch.Tensor:
    """‖W_i‖² per row, [d_out] in the compute dtype (fp32; float64 for a float64 W)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [d_out, d_in]; got shape {tuple(weight.shape)}")
    # vector_norm(dtype=...) upcasts inside the reduction, so no chunk of W is ever copied:
    # chunking only adds launches unless the caller asks for it.
    chunk = checks.check_chunk(chunk_size)
    acc = compute_dtype(weight.dtype)
    parts = [
        torch.linalg.vector_norm(weight[:, c], dim=1, dtype=acc).square()
        for c in chunk_slices(weight.shape[1], chunk)
    ]
    return _sum(parts)


def _products(weight, a, *, chunk_size=None, want_u: bool = True, want_g: bool = True):
    """(U = W aᵀ [d_out, r] or None, G = a aᵀ [r, r] or None) in the compute dtype, with a
    already rounded to W's dtype. On CUDA with a 16-bit W the GEMMs run in W's dtype with
    fp32 accumulation and output; elsewhere W and a are upcast (W in chunks of d_in, which
    bounds the copy; an fp32/fp64 W needs no copy, so no chunks unless asked for)."""
    d_in = weight.shape[1]
    lowp = _fast_lowp(weight)
    acc = torch.float32 if lowp else compute_dtype(weight.dtype)
    if lowp:

        def prod(p, q):
            return mm_out(p, q, torch.float32)
    else:

        def prod(p, q):
            return p.to(acc) @ q.to(acc)

    default = None if lowp or weight.dtype == acc else config.NORM_CHUNK
    cols = chunk_slices(d_in, chunk_size or default)
    U = _sum(prod(weight[:, c], a[:, c].t()) for c in cols) if want_u else None
    G = _sum(prod(a[:, c], a[:, c].t()) for c in cols) if want_g else None
    return U, G


def gram(lora_A, weight, *, chunk_size=None) -> torch.Tensor:
    """G = A Aᵀ [r, r] in the compute dtype, A rounded to W's dtype (docs/design.md §5)."""
    return _products(weight, rounded_a(lora_A, weight), chunk_size=chunk_size, want_u=False)[1]


def cross_terms(weight, lora_A, *, chunk_size=None) -> torch.Tensor:
    """U = W Aᵀ [d_out, r] in the compute dtype, A rounded to W's dtype."""
    return _products(weight, rounded_a(lora_A, weight), chunk_size=chunk_size, want_g=False)[0]


def assemble(
    base_sq, U, lora_B, G, scaling: float, *, fused: bool, bf16x3: bool = False
) -> torch.Tensor:
    """n = sqrt(max(base_sq + 2s·Σ B⊙U + s²·Σ (B G)⊙B, 0)), [d_out] in U's dtype. B enters
    at U's precision (≥ fp32), never rounded to the activation dtype, except that the fused
    tier's gemm assembly may split B and G into bf16 pairs (``bf16x3``: W is 16-bit; design
    §5)."""
    if fused and U.dtype == torch.float32:
        from .kernels.norm import assemble_norm

        return assemble_norm(base_sq, U, lora_B.detach(), G, scaling, bf16x3=bf16x3)
    b = lora_B.detach().to(U.dtype)
    sq = base_sq + 2.0 * scaling * (b * U).sum(1) + scaling * scaling * ((b @ G) * b).sum(1)
    return sq.clamp_min(0.0).sqrt()


def detached_norm(
    weight, lora_A, lora_B, base_sq, scaling: float, fused: bool, chunk_size=None, *, a_cast=None
):
    """The norm without a graph or argument checks (callers validated them), [d_out] in the
    compute dtype. ``base_sq``: the cached ‖W_i‖², or None to compute it here. ``a_cast``:
    lora_A already cast to some dtype (a module cache's cast), reused when that is W's dtype.

    Fused, at small ranks: one pass over W (``kernels/norm_pass.py``). Otherwise U only ever
    exists for ``config.norm_row_chunk(r)`` rows at a time (bounded transient).
    """
    a = a_cast if a_cast is not None and a_cast.dtype == weight.dtype else None
    a = rounded_a(lora_A, weight) if a is None else a
    if fused and chunk_size is None and norm_pass_applies(weight, a.shape[0]):
        return norm_pass(weight, a, lora_B.detach(), base_sq, scaling)
    if base_sq is None:
        base_sq = base_sq_norm(weight, chunk_size=chunk_size)
    rows_per_block = config.norm_row_chunk(a.shape[0])
    if weight.shape[0] <= rows_per_block:  # the common case: one block, no slicing
        U, G = _products(weight, a, chunk_size=chunk_size)
        return assemble(base_sq, U, lora_B, G, scaling, fused=fused, bf16x3=_lowp(weight))
    G = _products(weight, a, chunk_size=chunk_size, want_u=False)[1]
    out = []
    for rows in chunk_slices(weight.shape[0], rows_per_block):
        U = _products(weight[rows], a, chunk_size=chunk_size, want_g=False)[0]
        part = assemble(
            base_sq[rows], U, lora_B[rows], G, scaling, fused=fused, bf16x3=_lowp(weight)
        )
        out.append(part)
    return torch.cat(out)


class _FactoredNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, lora_A, lora_B, base_sq, scaling, chunk_size, fused):
        ctx.scaling = scaling
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            if base_sq is None:
                base_sq = base_sq_norm(weight, chunk_size=chunk_size)
            U, G = _products(weight, rounded_a(lora_A, weight), chunk_size=chunk_size)
            n = assemble(base_sq, U, lora_B, G, scaling, fused=fused, bf16x3=_lowp(weight))
            ctx.save_for_backward(weight, lora_A, lora_B, U, G, n)
            return n
        return detached_norm(weight, lora_A, lora_B, base_sq, scaling, fused, chunk_size)

    @staticmethod
    def backward(ctx, dn):
        weight, lora_A, lora_B, U, G, n = ctx.saved_tensors
        s, acc = ctx.scaling, n.dtype
        c = torch.where(n >= config.EPS, dn.to(acc) / n.clamp_min(config.EPS), 0.0)
        b = lora_B.to(acc)
        cb = c[:, None] * b
        dA = dB = None
        if ctx.needs_input_grad[2]:
            dB = (c[:, None] * (s * U + (s * s) * (b @ G))).to(lora_B.dtype)
        if ctx.needs_input_grad[1]:
            cross = mm_out(cb.to(weight.dtype).t().contiguous(), weight, acc)
            a = rounded_a(lora_A, weight).to(acc)
            dA = (s * cross + (s * s) * ((b.t() @ cb) @ a)).to(lora_A.dtype)
        return None, dA, dB, None, None, None, None


def factored_norm(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    base_sq: torch.Tensor | None = None,
    chunk_size: int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Row norm ‖W + s·B·A‖ without forming B·A.

    Args:
      weight: [d_out, d_in] (frozen; no gradient flows to it).
      lora_A: [r, d_in]. lora_B: [d_out, r]. Any float dtypes, on weight's device.
      scaling: s (a Python number).
      base_sq: optional cached ‖W_i‖² [d_out] in the compute dtype.
      chunk_size: accumulate over slices of d_in of this width (bounds the transient).
      impl: "auto" (Triton assembly on CUDA), "fused" or "eager".

    Returns [d_out] in the compute dtype promote(fp32, W's dtype): the true norm (≥ 0; clamp
    with ``magnitude_scale``). Differentiable in lora_A and lora_B (exact docs/design.md §2
    gradient); wrap in ``torch.no_grad()`` or detach for the usual detached-norm DoRA.
    """
    d_out, _, _ = checks.check_adapter(weight, lora_A, lora_B)
    s = checks.check_scaling(scaling)
    chunk = checks.check_chunk(chunk_size)
    checks.check_impl(impl)
    if base_sq is not None and (
        tuple(base_sq.shape) != (d_out,) or base_sq.dtype != compute_dtype(weight.dtype)
    ):
        raise ValueError(
            f"base_sq must be {compute_dtype(weight.dtype)} of shape ({d_out},); got "
            f"{base_sq.dtype} {tuple(base_sq.shape)}"
        )
    # The Triton assembly is fp32: a float64 norm is always assembled by torch ops.
    fused = impl == "fused" or (impl == "auto" and weight.is_cuda)
    if not (torch.is_grad_enabled() and (lora_A.requires_grad or lora_B.requires_grad)):
        # No graph needed: skip the autograd.Function's host overhead (the common case).
        return detached_norm(weight.detach(), lora_A, lora_B, base_sq, s, fused, chunk)
    return _FactoredNorm.apply(weight.detach(), lora_A, lora_B, base_sq, s, chunk, fused)
