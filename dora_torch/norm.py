"""The factored DoRA norm (DESIGN §2): never builds B·A.

    n_i² = ‖W_i‖² + 2s·Σ_j B_ij U_ij + s²·Σ_jk B_ij G_jk B_ik,   U = W Aᵀ, G = A Aᵀ

All intermediates are O(d_out·r + r²) and fp32; without a gradient U is formed for
``config.NORM_ROW_CHUNK`` rows at a time. ``‖W‖²`` is the frozen part (callers cache it).
U and G come from GEMMs: on CUDA with a 16-bit weight, ``W @ A_cᵀ`` with A cast to the
weight's dtype and fp32 accumulation/output (the adapter dtype policy, DESIGN §5);
elsewhere W is upcast to fp32 in chunks of d_in. The assembly is one Triton kernel (fused
tier) or a few torch ops (eager tier).

``factored_norm`` is differentiable in lora_A and lora_B with the exact, cheap gradient
(DESIGN §2), which is how ``exact_norm_grad=True`` is implemented: with c = (dL/dn) / n,

    dB = c ⊙_rows (s·U + s²·B G),   dA = s·(c ⊙_rows B)ᵀ W + s²·(Bᵀ diag(c) B) A
"""

from __future__ import annotations

import torch

from . import checks, config
from .matmul import mm_out


def _columns(d_in: int, chunk: int | None):
    step = d_in if chunk is None else chunk
    return [slice(i, min(i + step, d_in)) for i in range(0, max(d_in, 1), max(step, 1))]


def _sum(terms):
    """Sum of tensors without Python's ``0 +`` (an extra kernel launch for one term)."""
    it = iter(terms)
    total = next(it)
    for term in it:
        total = total + term
    return total


def _fast_lowp(weight: torch.Tensor) -> bool:
    return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)


@torch.no_grad()
def base_sq_norm(weight: torch.Tensor, *, chunk_size: int | None = None) -> torch.Tensor:
    """‖W_i‖² per row: fp32 [d_out] from weight [d_out, d_in] (fp32 accumulation)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [d_out, d_in]; got shape {tuple(weight.shape)}")
    # vector_norm(dtype=fp32) upcasts inside the reduction, so no chunk of W is ever copied:
    # chunking only adds launches unless the caller asks for it. fp64 is reduced in fp64 (the
    # op refuses to narrow), then rounded to the fp32 the norm is kept in.
    chunk = checks.check_chunk(chunk_size)
    acc = None if weight.dtype == torch.float64 else torch.float32
    parts = [
        torch.linalg.vector_norm(weight[:, c], dim=1, dtype=acc).square()
        for c in _columns(weight.shape[1], chunk)
    ]
    return _sum(parts).float()


def gram(lora_A, weight, *, chunk_size=None) -> torch.Tensor:
    """G = A Aᵀ, fp32 [r, r] (A in weight's dtype on CUDA with a 16-bit weight, else fp32)."""
    if _fast_lowp(weight):
        a = lora_A.detach().to(weight.dtype)
        if chunk_size is None:
            return mm_out(a, a.t(), torch.float32)
        return _sum(
            mm_out(a[:, c], a[:, c].t(), torch.float32) for c in _columns(a.shape[1], chunk_size)
        )
    r, d_in = lora_A.shape
    G = torch.zeros(r, r, dtype=torch.float32, device=weight.device)
    for c in _columns(d_in, chunk_size or config.NORM_CHUNK):
        a = lora_A.detach()[:, c].float()
        G += a @ a.t()
    return G


def cross_terms(weight, lora_A, *, chunk_size=None) -> torch.Tensor:
    """U = W Aᵀ, fp32 [d_out, r], accumulated over d_in chunks."""
    d_out, d_in = weight.shape
    if _fast_lowp(weight):
        a = lora_A.detach().to(weight.dtype)
        if chunk_size is None:
            return mm_out(weight, a.t(), torch.float32)
        return _sum(
            mm_out(weight[:, c], a[:, c].t(), torch.float32) for c in _columns(d_in, chunk_size)
        )
    # Upcast W in chunks of d_in (bounds the fp32 copy); an fp32 W needs no copy, so no chunks.
    default = None if weight.dtype == torch.float32 else config.NORM_CHUNK
    U = torch.zeros(d_out, lora_A.shape[0], dtype=torch.float32, device=weight.device)
    for c in _columns(d_in, chunk_size or default):
        U += weight[:, c].float() @ lora_A.detach()[:, c].float().t()
    return U


def assemble(base_sq, U, lora_B, G, scaling: float, *, fused: bool) -> torch.Tensor:
    """n = sqrt(max(base_sq + 2s·Σ B⊙U + s²·Σ (B G)⊙B, 0)), fp32 [d_out]."""
    if fused:
        from .kernels.norm import assemble_norm

        return assemble_norm(base_sq, U, lora_B.detach(), G, scaling)
    b = lora_B.detach().float()
    sq = base_sq + 2.0 * scaling * (b * U).sum(1) + scaling * scaling * ((b @ G) * b).sum(1)
    return sq.clamp_min(0.0).sqrt()


def detached_norm(weight, lora_A, lora_B, base_sq, scaling: float, fused: bool, chunk_size=None):
    """The norm without a graph or argument checks (callers validated them): fp32 [d_out].

    U only ever exists for ``config.NORM_ROW_CHUNK`` rows at a time (bounded transient).
    On CUDA with a 16-bit W, lora_A may already be in W's dtype (the cast is then free).
    """
    if _fast_lowp(weight):
        lora_A = lora_A.detach().to(weight.dtype)  # cast once for G and every block of U
    G = gram(lora_A, weight, chunk_size=chunk_size)
    step = config.NORM_ROW_CHUNK
    if weight.shape[0] <= step:  # the common case: one block, no slicing
        U = cross_terms(weight, lora_A, chunk_size=chunk_size)
        return assemble(base_sq, U, lora_B, G, scaling, fused=fused)
    out = []
    for i in range(0, weight.shape[0], step):
        rows = slice(i, i + step)
        U = cross_terms(weight[rows], lora_A, chunk_size=chunk_size)
        out.append(assemble(base_sq[rows], U, lora_B[rows], G, scaling, fused=fused))
    return torch.cat(out)


class _FactoredNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, lora_A, lora_B, base_sq, scaling, chunk_size, fused):
        ctx.scaling = scaling
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            U = cross_terms(weight, lora_A, chunk_size=chunk_size)
            G = gram(lora_A, weight, chunk_size=chunk_size)
            n = assemble(base_sq, U, lora_B, G, scaling, fused=fused)
            ctx.save_for_backward(weight, lora_A, lora_B, U, G, n)
            return n
        return detached_norm(weight, lora_A, lora_B, base_sq, scaling, fused, chunk_size)

    @staticmethod
    def backward(ctx, dn):
        weight, lora_A, lora_B, U, G, n = ctx.saved_tensors
        s = ctx.scaling
        c = torch.where(n >= config.EPS, dn.float() / n.clamp_min(config.EPS), 0.0)
        b = lora_B.float()
        cb = c[:, None] * b
        dA = dB = None
        if ctx.needs_input_grad[2]:
            dB = (c[:, None] * (s * U + (s * s) * (b @ G))).to(lora_B.dtype)
        if ctx.needs_input_grad[1]:
            cross = mm_out(cb.to(weight.dtype).t().contiguous(), weight, torch.float32)
            dA = (s * cross + (s * s) * ((b.t() @ cb) @ lora_A.float())).to(lora_A.dtype)
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
      base_sq: optional cached ‖W_i‖², fp32 [d_out].
      chunk_size: accumulate over slices of d_in of this width (bounds the transient).
      impl: "auto" (Triton assembly on CUDA), "fused" or "eager".

    Returns fp32 [d_out], the true norm (≥ 0; clamp with ``magnitude_scale``). Differentiable
    in lora_A and lora_B (exact DESIGN §2 gradient); wrap in ``torch.no_grad()`` or detach
    for the usual detached-norm DoRA.
    """
    d_out, _, _ = checks.check_adapter(weight, lora_A, lora_B)
    s = checks.check_scaling(scaling)
    chunk = checks.check_chunk(chunk_size)
    checks.check_impl(impl)
    if base_sq is None:
        base_sq = base_sq_norm(weight, chunk_size=chunk)
    elif tuple(base_sq.shape) != (d_out,) or base_sq.dtype != torch.float32:
        raise ValueError(
            f"base_sq must be fp32 of shape ({d_out},); got {base_sq.dtype} {tuple(base_sq.shape)}"
        )
    fused = impl == "fused" or (impl == "auto" and weight.is_cuda)
    if not (torch.is_grad_enabled() and (lora_A.requires_grad or lora_B.requires_grad)):
        # No graph needed: skip the autograd.Function's host overhead (the common case).
        return detached_norm(weight.detach(), lora_A, lora_B, base_sq, s, fused, chunk)
    return _FactoredNorm.apply(weight.detach(), lora_A, lora_B, base_sq, s, chunk, fused)
