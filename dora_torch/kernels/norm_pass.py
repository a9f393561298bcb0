"""The whole factored norm in one pass over W, for small ranks (docs/design.md §2, §6).

    n_i = sqrt(max(‖W_i‖² + 2s·Σ_j B_ij U_ij + s²·Σ_j (B G)_ij B_ij, 0)),
    U = W Aᵀ [d_out, r],  G = A Aᵀ [r, r]

One program per block of rows walks d_in once: each W tile feeds U (tensor-core dot with A's
tile, fp32 accumulation) and, unless ‖W‖² is given, the fp32 sum of squares; G is
accumulated from the same A tiles (every program forms all of it: r²·d_in multiply-adds,
small next to its rows' r·d_in·BLOCK_M for r ≤ ``config.NORM_PASS_MAX_RANK``). The epilogue
assembles n from the rows of B, as ``_norm_assemble_kernel`` does, with the (B G) product at
``config.NORM_DOT_PRECISION``. Neither U, G nor ‖W‖² reaches memory, and one launch
replaces four (‖W‖², the U and G GEMMs, the assembly). Precision rule (§5) unchanged: A
arrives rounded to W's dtype, U and G are fp32 accumulations of its products, B enters at
fp32. Where the norm is recomputed with ‖W‖² every call (compiled training graphs), W is
read once instead of twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import config
from .common import cdiv, check_launchable, dot_fp32, dot_precision, next_pow2, unit_stride
from .launch import Launcher
from .norm import resolve_method


@triton.jit
def _norm_pass_kernel(
    w_ptr,
    a_ptr,
    lb_ptr,
    base_sq_ptr,
    out_ptr,
    N,
    D,
    R,
    stride_wn,
    stride_wd,
    stride_ar,
    stride_ad,
    stride_bn,
    stride_br,
    s,
    HAS_BASE_SQ: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BG_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program i: row block i over all of d_in, then n for its rows (see the module
    docstring)."""
    # Scalars arrive as fp64 when Inductor launches the kernel: keep the math in fp32.
    s = tl.cast(s, tl.float32)
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rs = tl.arange(0, BLOCK_R)
    mask_m = rows < N
    mask_r = rs < R
    U = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    G = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        mask_d = ds < D
        w = tl.load(
            w_ptr + rows[:, None] * stride_wn + ds[None, :] * stride_wd,
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + rs[:, None] * stride_ar + ds[None, :] * stride_ad,
            mask=mask_r[:, None] & mask_d[None, :],
            other=0.0,
        )
        if not HAS_BASE_SQ:
            wf = w.to(tl.float32)
            sq += wf * wf
        if DOT_FP32:
            w = w.to(tl.float32)
            a = a.to(tl.float32)
        at = tl.trans(a)
        U = tl.dot(w, at, U, input_precision=DOT_PRECISION)
        G = tl.dot(a, at, G, input_precision=DOT_PRECISION)
    if HAS_BASE_SQ:
        base = tl.load(base_sq_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
    else:
        base = tl.sum(sq, axis=1)
    b = tl.load(
        lb_ptr + rows[:, None] * stride_bn + rs[None, :] * stride_br,
        mask=mask_m[:, None] & mask_r[None, :],
        other=0.0,
    ).to(tl.float32)
    cross = tl.sum(b * U, axis=1)
    gram = tl.sum(tl.dot(b, G, input_precision=BG_PRECISION) * b, axis=1)
    n_sq = base + 2.0 * s * cross + s * s * gram
    tl.store(out_ptr + rows, tl.sqrt(tl.maximum(n_sq, 0.0)), mask=mask_m)


_launch_norm_pass = Launcher(_norm_pass_kernel)


def norm_pass_applies(weight: torch.Tensor, r: int) -> bool:
    """Whether ``norm_pass`` computes the norm of ``weight`` at rank r: a 16-bit or fp32 W on
    CUDA (or the interpreter), r ≤ ``config.NORM_PASS_MAX_RANK``, and the kernel assembly
    chosen for r (``config.NORM_ASSEMBLY``)."""
    if not (1 <= r <= config.NORM_PASS_MAX_RANK):
        return False
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if not (weight.is_cuda or config.interpreting()):
        return False
    return resolve_method(None, r, weight.dtype != torch.float32) == "kernel"


def norm_pass(
    weight: torch.Tensor,
    a: torch.Tensor,
    lora_B: torch.Tensor,
    base_sq: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """n [d_out] fp32 of W [d_out, d_in] (16-bit or fp32), a = A rounded to W's dtype [r, d_in],
    lora_B [d_out, r] (any float dtype); ``base_sq`` the cached ‖W_i‖² (fp32 [d_out]) or None
    to compute it in the same pass. See the module docstring; callers check
    ``norm_pass_applies``."""
    check_launchable(weight, a)
    if base_sq is not None:
        (base_sq,) = unit_stride(base_sq)
    N, D = weight.shape
    R = a.shape[0]
    out = torch.empty(N, dtype=torch.float32, device=weight.device)
    if N == 0:
        return out
    bm, bd, warps, stages = config.NORM_PASS_BLOCKS
    bm, bd = config.interp_small(bm), config.interp_small(bd)
    br = max(16, next_pow2(R))
    _launch_norm_pass(
        (cdiv(N, bm),),  # one program per row block (d_in = 0: an empty loop, n² = ‖W‖²)
        weight,
        a,
        lora_B,
        out if base_sq is None else base_sq,  # a valid pointer when unused
        out,
        N,
        D,
        R,
        *weight.stride(),
        *a.stride(),
        *lora_B.stride(),
        float(scaling),
        HAS_BASE_SQ=base_sq is not None,
        DOT_FP32=dot_fp32(weight.dtype),
        DOT_PRECISION=dot_precision(weight.dtype),
        BG_PRECISION="ieee" if config.interpreting() else config.NORM_DOT_PRECISION,
        BLOCK_M=bm,
        BLOCK_D=bd,
        BLOCK_R=br,
        num_warps=warps,
        num_stages=stages,
    )
    return out
