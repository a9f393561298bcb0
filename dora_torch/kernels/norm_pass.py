"""The whole factored norm in one pass over W, for small ranks (docs/design.md §2, §6).

    n_i = sqrt(max(‖W_i‖² + 2s·Σ_j B_ij U_ij + s²·Σ_j (B G)_ij B_ij, 0)),
    U = W Aᵀ [d_out, r],  G = A Aᵀ [r, r]

Programs tile rows × slices of d_in; each walks its slice once: every W tile feeds U
(tensor-core dot with A's tile, fp32 accumulation) and, unless ‖W‖² is given, the fp32 sum
of squares; G is accumulated from the same A tiles (r²·d_in multiply-adds, small next to the
rows' r·d_in·BLOCK_M for r ≤ ``config.NORM_PASS_MAX_RANK``). With one slice the program
assembles n from the rows of B in its epilogue (as ``_norm_assemble_kernel`` does, B·G at
``config.NORM_DOT_PRECISION``): one launch replaces four (‖W‖², the U and G GEMMs, the
assembly) and nothing but n reaches memory. Where rows alone give too few programs to keep
the GPU's memory system busy (d_out = 4096 is 64 programs of 64 rows), d_in is split
(``config.NORM_PASS_SPLIT``, ``common.splits_to_fill``): each program writes its partial U,
‖W‖² and (from the first rows block) G, O((d_out + r)·r) fp32 per slice, and
``_norm_pass_finish_kernel`` sums them in slice order (deterministic, no atomics) and
assembles n. Precision rule (§5) unchanged: A arrives rounded to W's dtype, U and G are fp32
accumulations of its products, B enters at fp32. Where the norm is recomputed with ‖W‖²
every call (compiled training graphs), W is read once instead of twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import config
from .common import (
    cdiv,
    check_launchable,
    dot_fp32,
    dot_precision,
    next_pow2,
    splits_to_fill,
    unit_stride,
)
from .launch import Launcher
from .norm import assembly_method


@triton.jit
def _assemble_rows(base, U, b, G, s, BG_PRECISION: tl.constexpr):
    """n of a block of rows from ‖W_i‖² [BM], U [BM, BR], B's rows [BM, BR] fp32, G [BR, BR]."""
    cross = tl.sum(b * U, axis=1)
    gram = tl.sum(tl.dot(b, G, input_precision=BG_PRECISION) * b, axis=1)
    return tl.sqrt(tl.maximum(base + 2.0 * s * cross + s * s * gram, 0.0))


@triton.jit
def _norm_pass_kernel(
    w_ptr,
    a_ptr,
    lb_ptr,
    base_sq_ptr,
    out_ptr,
    u_part_ptr,
    sq_part_ptr,
    g_part_ptr,
    N,
    D,
    R,
    d_slice,
    stride_wn,
    stride_wd,
    stride_ar,
    stride_ad,
    stride_bn,
    stride_br,
    s,
    HAS_BASE_SQ: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BG_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (i, k) walks columns [k·d_slice, (k+1)·d_slice) of rows block i. Without SPLIT
    (one slice) it assembles n itself; with it, it writes its partial U [BM, R] and ‖W‖²
    (and slice k's G from the programs of rows block 0) for ``_norm_pass_finish_kernel``."""
    # Scalars arrive as fp64 when Inductor launches the kernel: keep the math in fp32.
    s = tl.cast(s, tl.float32)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rs = tl.arange(0, BLOCK_R)
    mask_m = rows < N
    mask_r = rs < R
    d_lo = pid_k * d_slice
    d_hi = tl.minimum(D, d_lo + d_slice)
    U = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    G = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        mask_d = ds < d_hi
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
        if SPLIT:  # one rows block per slice forms the slice's G
            if pid_m == 0:
                G = tl.dot(a, at, G, input_precision=DOT_PRECISION)
        else:
            G = tl.dot(a, at, G, input_precision=DOT_PRECISION)
    if SPLIT:
        part = pid_k * N + rows
        mask_mr = mask_m[:, None] & mask_r[None, :]
        tl.store(u_part_ptr + part[:, None] * R + rs[None, :], U, mask=mask_mr)
        if not HAS_BASE_SQ:
            tl.store(sq_part_ptr + part, tl.sum(sq, axis=1), mask=mask_m)
        if pid_m == 0:
            g_at = g_part_ptr + pid_k * R * R + rs[:, None] * R + rs[None, :]
            tl.store(g_at, G, mask=mask_r[:, None] & mask_r[None, :])
    else:
        if HAS_BASE_SQ:
            base = tl.load(base_sq_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
        else:
            base = tl.sum(sq, axis=1)
        b = tl.load(
            lb_ptr + rows[:, None] * stride_bn + rs[None, :] * stride_br,
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        ).to(tl.float32)
        tl.store(out_ptr + rows, _assemble_rows(base, U, b, G, s, BG_PRECISION), mask=mask_m)


@triton.jit
def _norm_pass_finish_kernel(
    u_part_ptr,
    sq_part_ptr,
    g_part_ptr,
    base_sq_ptr,
    lb_ptr,
    out_ptr,
    N,
    R,
    splits,
    stride_bn,
    stride_br,
    s,
    HAS_BASE_SQ: tl.constexpr,
    BG_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Sums the slices' partial U, ‖W‖² and G in slice order (deterministic) and assembles n."""
    s = tl.cast(s, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rs = tl.arange(0, BLOCK_R)
    mask_m = rows < N
    mask_r = rs < R
    mask_mr = mask_m[:, None] & mask_r[None, :]
    mask_rr = mask_r[:, None] & mask_r[None, :]
    U = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    G = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
    base = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, splits):
        part = k * N + rows
        U += tl.load(u_part_ptr + part[:, None] * R + rs[None, :], mask=mask_mr, other=0.0)
        G += tl.load(
            g_part_ptr + k * R * R + rs[:, None] * R + rs[None, :], mask=mask_rr, other=0.0
        )
        if not HAS_BASE_SQ:
            base += tl.load(sq_part_ptr + part, mask=mask_m, other=0.0)
    if HAS_BASE_SQ:
        base = tl.load(base_sq_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
    b = tl.load(
        lb_ptr + rows[:, None] * stride_bn + rs[None, :] * stride_br, mask=mask_mr, other=0.0
    ).to(tl.float32)
    tl.store(out_ptr + rows, _assemble_rows(base, U, b, G, s, BG_PRECISION), mask=mask_m)


_launch_norm_pass = Launcher(_norm_pass_kernel)
_launch_finish = Launcher(_norm_pass_finish_kernel)


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
    method = config.NORM_ASSEMBLY
    return (assembly_method(r) if method == "auto" else method) == "kernel"


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
    tiles = cdiv(D, bd)
    split = config.NORM_PASS_SPLIT
    if split is None:
        split = splits_to_fill(cdiv(N, bm), weight.device, tiles)
    split = max(1, min(split, tiles))
    d_slice = cdiv(tiles, split) * bd
    split = cdiv(D, d_slice)  # no empty slices
    cached = base_sq is not None
    bg_precision = "ieee" if config.interpreting() else config.NORM_DOT_PRECISION
    if split > 1:
        f32 = dict(dtype=torch.float32, device=weight.device)
        u_part = torch.empty((split, N, R), **f32)
        sq_part = u_part if cached else torch.empty((split, N), **f32)
        g_part = torch.empty((split, R, R), **f32)
    else:
        u_part = sq_part = g_part = out  # valid pointers, unused
    _launch_norm_pass(
        (cdiv(N, bm), split),
        weight,
        a,
        lora_B,
        base_sq if cached else out,  # a valid pointer when unused
        out,
        u_part,
        sq_part,
        g_part,
        N,
        D,
        R,
        d_slice,
        weight.stride(0),
        weight.stride(1),
        a.stride(0),
        a.stride(1),
        lora_B.stride(0),
        lora_B.stride(1),
        float(scaling),
        HAS_BASE_SQ=cached,
        SPLIT=split > 1,
        DOT_FP32=dot_fp32(weight.dtype),
        DOT_PRECISION=dot_precision(weight.dtype),
        BG_PRECISION=bg_precision,
        BLOCK_M=bm,
        BLOCK_D=bd,
        BLOCK_R=br,
        num_warps=warps,
        num_stages=stages,
    )
    if split > 1:
        fm = config.interp_small(config.NORM_PASS_FINISH_BLOCK_M)
        _launch_finish(
            (cdiv(N, fm),),
            u_part,
            sq_part,
            g_part,
            base_sq if cached else out,
            lora_B,
            out,
            N,
            R,
            split,
            lora_B.stride(0),
            lora_B.stride(1),
            float(scaling),
            HAS_BASE_SQ=cached,
            BG_PRECISION=bg_precision,
            BLOCK_M=fm,
            BLOCK_R=br,
            num_warps=4,
        )
    return out
