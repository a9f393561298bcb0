"""Backward elementwise pass of DoRA (detached norm, docs/design.md §4).

With g = m / max(n, eps) per output column and ``inner`` the tensor g multiplied in the
forward (x_d Wᵀ + s·h Bᵀ):

    dy_g  = g ⊙ dy                                  (input of the dx, dA, dB GEMMs)
    (dy_g and dy_g1 saturate at the dtype's finite range rather than overflow to inf)
    dy_g1 = (g − 1) ⊙ dy = ((m − n)/n) ⊙ dy          (dropout path only: the base-on-x_d GEMM)
    dm    = Σ_t dy ⊙ inner / max(n, eps)             (reduced over tokens)
    dbias = Σ_t dy

one pass over dy, partial sums per token chunk, added up in a fixed order (deterministic:
the only atomic is a ticket counter, never a sum). ``inner`` is either saved by the forward or
recovered from the output as ``inner = y / g`` (only when there is no bias, where it is as
accurate as a saved rounded inner). Columns with g = 0 (m = 0) have lost inner. In recover
mode the pass finishes dm itself: the last program of each column block to finish (the one
that draws the last ticket) adds up the block's partials and, where the block holds such a
column, recomputes its inner as x W_colsᵀ + s·h B_colsᵀ over all tokens (``_finish_dm``). The
rare case so needs no host sync and no launch of its own, and the loop over dy carries none of
the recompute's registers (inline in that loop the pass compiled to 255 registers and spilled
on sm_90, benchmarks/NOTES.md, session 14; after it, the registers are the larger of the two
parts', not their sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import config
from ..matmul import as_dtype
from .common import cdiv, check_launchable, dot_fp32, dot_precision, unit_stride
from .launch import Launcher
from .workspace import ticket_counters

_FINITE_MAX = {dt: torch.finfo(dt).max for dt in (torch.float16, torch.bfloat16, torch.float32)}


@triton.jit
def _inner_tile(
    x_ptr, w_ptr, h_ptr, lb_ptr, rows, cols, M, N, D, R,
    stride_xm, stride_xd, stride_wn, stride_wd, stride_hm, s,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """inner[rows, cols] = x W_colsᵀ + s·h B_colsᵀ in fp32 (h [M, R] with unit column stride,
    B [N, R] contiguous)."""
    mask_m = rows < M
    mask_n = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        xt = tl.load(
            x_ptr + rows[:, None] * stride_xm + ds[None, :] * stride_xd,
            mask=mask_m[:, None] & (ds < D)[None, :],
            other=0.0,
        )
        wt = tl.load(
            w_ptr + cols[None, :] * stride_wn + ds[:, None] * stride_wd,
            mask=mask_n[None, :] & (ds < D)[:, None],
            other=0.0,
        )
        if DOT_FP32:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, wt, acc, input_precision=DOT_PRECISION)
    lora = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        ht = tl.load(
            h_ptr + rows[:, None] * stride_hm + rs[None, :],
            mask=mask_m[:, None] & (rs < R)[None, :],
            other=0.0,
        )
        bt = tl.load(
            lb_ptr + cols[None, :] * R + rs[:, None],
            mask=mask_n[None, :] & (rs < R)[:, None],
            other=0.0,
        )
        if DOT_FP32:
            ht = ht.to(tl.float32)
            bt = bt.to(tl.float32)
        lora = tl.dot(ht, bt, lora, input_precision=DOT_PRECISION)
    return acc + s * lora


@triton.jit
def _finish_dm(
    dm_part_ptr, dm_ptr, m_ptr, n_ptr, col0, dy_ptr, x_ptr, w_ptr, h_ptr, lb_ptr,
    M, N, D, R, parts, stride_dym, stride_dyn, stride_xm, stride_xd, stride_wn, stride_wd,
    stride_hm, s, EPS: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, SUB_M: tl.constexpr, SUB_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """dm of the columns [col0, col0 + BLOCK_N), rounded once to dm_ptr's dtype: the sum of
    the partials in a fixed order; a column with g = 0 (m = 0, or m / n below fp32's range)
    instead gets Σ_t dy ⊙ inner / n over all M tokens, inner recomputed as
    x W_colᵀ + s·h B_colᵀ: its recovered inner y / g was lost, and the pass over dy, which
    tests g the same way, left its term at 0.

    The recompute walks [SUB_M, SUB_N] tiles, smaller than the pass's: the kernel's register
    count is the larger of the pass's and this path's, and at the pass's tile this path set
    it (248 against 125 on sm_90, ``benchmarks.kernel_resources``). The partials were written
    by other programs: they are loaded from L2 (".cg"), past this SM's L1."""
    cols = col0 + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    dm = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for p in range(0, parts):
        dm += tl.load(dm_part_ptr + p * N + cols, mask=mask_n, other=0.0, cache_modifier=".cg")
    mag = tl.load(m_ptr + cols, mask=mask_n, other=1.0).to(tl.float32)
    nrm = tl.maximum(tl.load(n_ptr + cols, mask=mask_n, other=1.0).to(tl.float32), EPS)
    zero_col = (mag / nrm == 0.0) & mask_n
    # Disjoint stores: these columns here, the zero ones below (no ordering between them).
    tl.store(dm_ptr + cols, dm.to(dm_ptr.dtype.element_ty), mask=mask_n & ~zero_col)
    if tl.max(zero_col.to(tl.int32), axis=0) > 0:
        for c0 in range(0, BLOCK_N, SUB_N):
            sub = col0 + c0 + tl.arange(0, SUB_N)
            mask_s = sub < N
            mag_s = tl.load(m_ptr + sub, mask=mask_s, other=1.0).to(tl.float32)
            nrm_s = tl.maximum(tl.load(n_ptr + sub, mask=mask_s, other=1.0).to(tl.float32), EPS)
            zero_s = (mag_s / nrm_s == 0.0) & mask_s
            if tl.max(zero_s.to(tl.int32), axis=0) > 0:
                acc = tl.zeros((SUB_M, SUB_N), dtype=tl.float32)
                for r0 in range(0, M, SUB_M):
                    rows = r0 + tl.arange(0, SUB_M)
                    mask = (rows < M)[:, None] & mask_s[None, :]
                    dy = tl.load(
                        dy_ptr + rows[:, None] * stride_dym + sub[None, :] * stride_dyn,
                        mask=mask,
                        other=0.0,
                    ).to(tl.float32)
                    inner = _inner_tile(
                        x_ptr, w_ptr, h_ptr, lb_ptr, rows, sub, M, N, D, R,
                        stride_xm, stride_xd, stride_wn, stride_wd, stride_hm, s,
                        DOT_FP32, DOT_PRECISION, SUB_M, SUB_N, BLOCK_D, BLOCK_R,
                    )  # fmt: skip
                    acc += dy * inner
                dm_s = tl.sum(acc, axis=0) / nrm_s
                tl.store(dm_ptr + sub, dm_s.to(dm_ptr.dtype.element_ty), mask=zero_s)


@triton.jit
def _scale_reduce_kernel(
    dy_ptr,
    saved_ptr,  # inner, or y when RECOVER
    m_ptr,
    n_ptr,
    dyg_ptr,
    dyg1_ptr,
    dm_part_ptr,  # [P, N] fp32
    db_part_ptr,  # [P, N] fp32
    dm_ptr,  # [N], RECOVER only: dm in the magnitude's dtype
    tickets_ptr,  # [cdiv(N, BLOCK_N)] int32, zero at entry and at exit; RECOVER only
    x_ptr,  # RECOVER only: x [M, D], W [N, D], h [M, R], B [N, R] (B contiguous)
    w_ptr,
    h_ptr,
    lb_ptr,
    M,
    N,
    D,
    R,
    rows_per_program,
    stride_dym,
    stride_dyn,
    stride_sm,
    stride_sn,
    stride_gm,
    stride_gn,
    stride_xm,
    stride_xd,
    stride_wn,
    stride_wd,
    stride_hm,
    OUT_MAX,
    s,
    EPS: tl.constexpr,
    RECOVER: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB_M: tl.constexpr,
    SUB_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # Scalars arrive as fp64 when Inductor launches the kernel: keep the math in fp32.
    OUT_MAX = tl.cast(OUT_MAX, tl.float32)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    mag = tl.load(m_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)
    nrm = tl.maximum(tl.load(n_ptr + cols, mask=mask_n, other=1.0).to(tl.float32), EPS)
    g = mag / nrm
    # y = g·inner (no bias) → inner = y / g; where g = 0 the term is 0 here and
    # _finish_dm recomputes that column's sum.
    inv_g = tl.where(g != 0.0, 1.0 / tl.where(g != 0.0, g, 1.0), 0.0)
    # Tile-shaped accumulators, reduced over tokens once after the loop: a reduction across
    # the tile's rows in every step would put a cross-warp exchange between the loads.
    acc_dm = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = pid_m * rows_per_program
    for i in range(0, rows_per_program, BLOCK_M):
        rows = start + i + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & mask_n[None, :]
        dy = tl.load(
            dy_ptr + rows[:, None] * stride_dym + cols[None, :] * stride_dyn, mask=mask, other=0.0
        ).to(tl.float32)
        sv = tl.load(
            saved_ptr + rows[:, None] * stride_sm + cols[None, :] * stride_sn, mask=mask, other=0.0
        ).to(tl.float32)
        if RECOVER:
            sv = sv * inv_g[None, :]
        acc_dm += dy * sv
        if HAS_DBIAS:
            acc_db += dy
        goff = rows[:, None] * stride_gm + cols[None, :] * stride_gn
        # Saturate instead of overflowing to inf: with a zero row (n clamped to eps) g is huge,
        # and inf · W_ij = inf · 0 would turn dx into NaN in fp16.
        dyg = tl.minimum(tl.maximum(dy * g[None, :], -OUT_MAX), OUT_MAX)
        tl.store(dyg_ptr + goff, dyg.to(dyg_ptr.dtype.element_ty), mask=mask)
        if DROPOUT:
            dyg1 = tl.minimum(tl.maximum(dy * ((mag - nrm) / nrm)[None, :], -OUT_MAX), OUT_MAX)
            tl.store(dyg1_ptr + goff, dyg1.to(dyg1_ptr.dtype.element_ty), mask=mask)
    tl.store(dm_part_ptr + pid_m * N + cols, tl.sum(acc_dm, axis=0) / nrm, mask=mask_n)
    if HAS_DBIAS:
        tl.store(db_part_ptr + pid_m * N + cols, tl.sum(acc_db, axis=0), mask=mask_n)
    if RECOVER:
        # The last program of this column block to get here adds the partials up and leaves
        # the ticket at zero (the scheme of kernels/workspace.py).
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel")
        if ticket == tl.cdiv(M, rows_per_program) - 1:
            _finish_dm(
                dm_part_ptr, dm_ptr, m_ptr, n_ptr, pid_n * BLOCK_N, dy_ptr, x_ptr, w_ptr, h_ptr,
                lb_ptr, M, N, D, R, tl.cdiv(M, rows_per_program), stride_dym, stride_dyn,
                stride_xm, stride_xd, stride_wn, stride_wd, stride_hm, tl.cast(s, tl.float32),
                EPS, DOT_FP32, DOT_PRECISION, BLOCK_N, SUB_M, SUB_N, BLOCK_D, BLOCK_R,
            )  # fmt: skip
            tl.store(tickets_ptr + pid_n, 0)


_launch_scale_reduce = Launcher(_scale_reduce_kernel)


def rows_for_programs(M: int, col_blocks: int, block_m: int, min_programs: int) -> int:
    """The most tokens per program, a multiple of block_m, for which the grid
    cdiv(M, rows) × col_blocks still holds ``min_programs`` programs; block_m when none does.
    (cdiv(M, rows) ≥ parts ⟺ rows ≤ (M − 1) // (parts − 1).)"""
    parts = cdiv(min_programs, col_blocks)
    if parts <= 1:
        return cdiv(M, block_m) * block_m
    return max(block_m, (M - 1) // (parts - 1) // block_m * block_m)


def scale_reduce(
    dy: torch.Tensor,
    saved: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    *,
    recover: bool,
    dropout: bool,
    need_dbias: bool,
    x: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    h: torch.Tensor | None = None,
    lora_B: torch.Tensor | None = None,
    scaling: float = 1.0,
    dm_dtype: torch.dtype = torch.float32,
    reduce_config: config.ReduceConfig | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """One pass over dy [T, d_out]. Returns (dy_g, dy_g1 or None, dm [d_out] in ``dm_dtype``
    (the magnitude's, so the gradient needs no cast of its own: in recover mode the program
    that finishes dm rounds the fp32 sum once as it stores it), dbias fp32 [d_out] or None).
    One launch in either mode.

    ``saved`` is inner, or y when ``recover``; then x [T, d_in], weight [d_out, d_in], h [T, r]
    and lora_B [d_out, r] (activation dtype) and ``scaling`` are needed too, to recompute inner
    for columns with g = 0 (magnitude 0, or m / n below fp32's range). ``reduce_config``
    overrides ``config.BWD`` (the benchmark sweeps candidates). ``out``: where dy_g goes, a
    [T, d_out] view with unit column stride (the stacked weights' [dy_g | s·t] rows); a new
    tensor by default. Not with ``dropout`` (dy_g1 takes dy_g's strides).
    """
    check_launchable(dy, saved)
    magnitude, norm = unit_stride(magnitude, norm)
    M, N = dy.shape
    if out is None:
        dyg = torch.empty((M, N), dtype=dy.dtype, device=dy.device)
    elif dropout or out.shape != (M, N) or out.dtype != dy.dtype or out.stride(1) != 1:
        raise ValueError(
            f"scale_reduce: out must be a {dy.dtype} [{M}, {N}] view with unit column stride, "
            f"without dropout; got {out.dtype} {tuple(out.shape)} strides {out.stride()}, "
            f"dropout={dropout}"
        )
    else:
        dyg = out
    dyg1 = torch.empty_like(dyg) if dropout else None
    if M == 0 or N == 0:
        dbias = torch.zeros(N, dtype=torch.float32, device=dy.device) if need_dbias else None
        return dyg, dyg1, torch.zeros(N, dtype=dm_dtype, device=dy.device), dbias
    if recover:
        if x is None or weight is None or h is None or lora_B is None:
            raise ValueError("scale_reduce(recover=True) needs x, weight, h and lora_B")
        if need_dbias:
            raise ValueError("scale_reduce(recover=True) is for layers without a bias: need_dbias")
        check_launchable(x, weight)
        lora_B = lora_B.contiguous()
        if h.stride(1) != 1:
            h = h.contiguous()
    cfg = reduce_config or config.BWD
    bm = config.interp_small(cfg.block_m)
    bn = config.interp_small(cfg.block_n, 32)
    rpp = max(bm, config.interp_small(cfg.rows_per_program, 64))
    if cfg.min_programs > 0:
        rpp = min(rpp, rows_for_programs(M, cdiv(N, bn), bm, cfg.min_programs))
    if M <= rpp:
        rpp = cdiv(M, bm) * bm  # one token chunk: no partial sums to add up (saves a launch)
    parts, col_blocks = cdiv(M, rpp), cdiv(N, bn)
    dm_part = torch.empty((parts, N), dtype=torch.float32, device=dy.device)
    db_part = torch.empty_like(dm_part) if need_dbias else dm_part
    if recover:
        # The interpreter rounds fp32 to 16 bits by truncation: there dm is cast on the host.
        store_dtype = torch.float32 if config.interpreting() else dm_dtype
        dm = torch.empty(N, dtype=store_dtype, device=dy.device)
        tickets = ticket_counters(dy.device, col_blocks)
        D, R = x.shape[1], h.shape[1]
    else:  # placeholders the kernel never reads
        dm, tickets, x, weight, h, lora_B, D, R = dm_part, dm_part, dy, dy, dy, dy, 0, 0
    _launch_scale_reduce(
        (parts, col_blocks),
        dy,
        saved,
        magnitude,
        norm,
        dyg,
        dyg1 if dropout else dyg,
        dm_part,
        db_part,
        dm,
        tickets,
        x,
        weight,
        h,
        lora_B,
        M,
        N,
        D,
        R,
        rpp,
        *dy.stride(),
        *saved.stride(),
        *dyg.stride(),
        *x.stride(),
        *weight.stride(),
        h.stride(0),
        _FINITE_MAX[dy.dtype],
        float(scaling),
        EPS=config.EPS,
        RECOVER=recover,
        DROPOUT=dropout,
        HAS_DBIAS=need_dbias,
        DOT_FP32=dot_fp32(dy.dtype),
        DOT_PRECISION=dot_precision(dy.dtype),
        BLOCK_M=bm,
        BLOCK_N=bn,
        SUB_M=config.BWD_SUB_M,
        SUB_N=min(config.BWD_SUB_N, bn),
        BLOCK_D=config.interp_small(config.BWD_BLOCK_D),
        BLOCK_R=config.interp_small(config.BWD_BLOCK_R),
        num_warps=cfg.num_warps,
    )
    if recover:  # no bias here (recover needs none), so no dbias partials
        return dyg, dyg1, as_dtype(dm, dm_dtype), None
    if parts == 1:  # one token chunk: the partial sums are the sums (saves a launch each)
        dm, dbias = dm_part[0], (db_part[0] if need_dbias else None)
    else:
        dm, dbias = dm_part.sum(0), (db_part.sum(0) if need_dbias else None)
    return dyg, dyg1, as_dtype(dm, dm_dtype), dbias
