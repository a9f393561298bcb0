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

A layer whose row blocks leave SMs idle (k and v of Llama-8B: 16 blocks of 64 rows) may also
split d_in into slices (``config.NORM_PASS_MAX_SLICES``, ``d_slice``): n² is linear in U, G
and the squares of W, so each (row block, slice) program stores its slice's share of n² (one
fp32 per row) and the last program of the row block to take a ticket adds the shares in slice
order and writes n (kernels/workspace.py): deterministic, with no U or G in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import config
from .common import cdiv, check_launchable, dot_fp32, dot_precision, next_pow2, unit_stride
from .launch import Launcher
from .norm import finish_norm_rows, resolve_method
from .workspace import ticket_counters


@triton.jit
def _norm_pass_kernel(
    w_ptr,
    a_ptr,
    lb_ptr,
    base_sq_ptr,
    part_ptr,
    tickets_ptr,
    out_ptr,
    N,
    D,
    R,
    SLICE,
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
    SPLIT_D: tl.constexpr,
):
    """Program (i, k): row block i over columns [k·SLICE, (k+1)·SLICE) of d_in (SLICE ≥ D and
    one column of programs unless ``SPLIT_D``). Each term of n² is linear in U, G and the
    squares of W, so a slice's programs form its share, 2s·Σ B⊙U_k + s²·Σ (B G_k)⊙B (+ its
    Σ W² when ‖W‖² is not given), store it in part [slices, N] and take a ticket; the last of
    a row block adds the shares up in slice order (kernels/workspace.py) and writes n."""
    # Scalars arrive as fp64 when Inductor launches the kernel: keep the math in fp32.
    s = tl.cast(s, tl.float32)
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rs = tl.arange(0, BLOCK_R)
    mask_m = rows < N
    mask_r = rs < R
    U = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    G = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    d_lo = pid_k * SLICE
    d_hi = tl.minimum(d_lo + SLICE, D)
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
    if SPLIT_D:
        share = 2.0 * s * cross + s * s * gram
        if not HAS_BASE_SQ:
            share += base
        finish_norm_rows(
            share, part_ptr, tickets_ptr, base_sq_ptr, out_ptr, rows, mask_m, pid_m, pid_k, N,
            HAS_BASE_SQ,
        )  # fmt: skip
    else:
        n_sq = base + 2.0 * s * cross + s * s * gram
        tl.store(out_ptr + rows, tl.sqrt(tl.maximum(n_sq, 0.0)), mask=mask_m)


_launch_norm_pass = Launcher(_norm_pass_kernel)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 132, an H100's, off CUDA (the interpreter), so
    that CPU tests split as an H100 would."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def d_slice(row_blocks: int, d_in: int, block_d: int, device: torch.device) -> int:
    """Columns of d_in per program of the one-pass norm: all of them (one program per row
    block) unless ``config.NORM_PASS_MAX_SLICES`` > 1 and the row blocks leave SMs idle; then
    up to that many slices, as many as fill the SMs, each a multiple of ``block_d`` and at
    least ``config.NORM_PASS_MIN_SLICE`` wide."""
    if config.NORM_PASS_MAX_SLICES <= 1:  # the default: no device query per call
        return max(d_in, 1)
    want = min(config.NORM_PASS_MAX_SLICES, cdiv(sm_count(device), row_blocks))
    want = min(want, max(1, d_in // max(config.NORM_PASS_MIN_SLICE, block_d)))
    if want <= 1:
        return max(d_in, 1)
    return cdiv(cdiv(d_in, want), block_d) * block_d


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
    row_blocks = cdiv(N, bm)
    width = d_slice(row_blocks, D, bd, weight.device)
    slices = max(1, cdiv(D, width))  # d_in = 0: one program per row block, n² = ‖W‖² = 0
    if slices > 1:
        part = torch.empty((slices, N), dtype=torch.float32, device=weight.device)
        tickets = ticket_counters(weight.device, row_blocks)
    else:  # placeholders the kernel never reads
        part = tickets = out
    _launch_norm_pass(
        (row_blocks, slices),
        weight,
        a,
        lora_B,
        out if base_sq is None else base_sq,  # a valid pointer when unused
        part,
        tickets,
        out,
        N,
        D,
        R,
        width,
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
        SPLIT_D=slices > 1,
        num_warps=warps,
        num_stages=stages,
    )
    return out
