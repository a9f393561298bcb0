"""Backward elementwise pass of DoRA (detached norm, DESIGN §4).

With g = m / max(n, eps) per output column and ``inner`` the tensor g multiplied in the
forward (x_d Wᵀ + s·h Bᵀ):

    dy_g  = g ⊙ dy                                  (input of the dx, dA, dB GEMMs)
    (dy_g and dy_g1 saturate at the dtype's finite range rather than overflow to inf)
    dy_g1 = (g − 1) ⊙ dy = ((m − n)/n) ⊙ dy          (dropout path only: the base-on-x_d GEMM)
    dm    = Σ_t dy ⊙ inner / max(n, eps)             (reduced over tokens)
    dbias = Σ_t dy

one pass over dy, partial sums per token chunk (deterministic: no atomics), summed by the
launcher. ``inner`` is either saved by the forward or recovered from the output as
``inner = y / g`` (only when there is no bias, where it is as accurate as a saved rounded
inner; rows with g = 0 have lost inner and are fixed by ``_zero_magnitude_dm_kernel``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import config
from .common import check_launchable, unit_stride


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
    M,
    N,
    rows_per_program,
    stride_dym,
    stride_dyn,
    stride_sm,
    stride_sn,
    stride_gm,
    stride_gn,
    eps,
    OUT_MAX,
    RECOVER: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    mag = tl.load(m_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)
    nrm = tl.maximum(tl.load(n_ptr + cols, mask=mask_n, other=1.0).to(tl.float32), eps)
    g = mag / nrm
    # y = g·inner (no bias) → inner = y / g; where g = 0 inner is unknown (fixed elsewhere).
    inv_g = tl.where(g != 0.0, 1.0 / tl.where(g != 0.0, g, 1.0), 0.0)
    acc_dm = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_db = tl.zeros((BLOCK_N,), dtype=tl.float32)
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
        acc_dm += tl.sum(dy * sv, axis=0)
        if HAS_DBIAS:
            acc_db += tl.sum(dy, axis=0)
        goff = rows[:, None] * stride_gm + cols[None, :] * stride_gn
        # Saturate instead of overflowing to inf: with a zero row (n clamped to eps) g is huge,
        # and inf · W_ij = inf · 0 would turn dx into NaN in fp16.
        dyg = tl.minimum(tl.maximum(dy * g[None, :], -OUT_MAX), OUT_MAX)
        tl.store(dyg_ptr + goff, dyg.to(dyg_ptr.dtype.element_ty), mask=mask)
        if DROPOUT:
            dyg1 = tl.minimum(tl.maximum(dy * ((mag - nrm) / nrm)[None, :], -OUT_MAX), OUT_MAX)
            tl.store(dyg1_ptr + goff, dyg1.to(dyg1_ptr.dtype.element_ty), mask=mask)
    tl.store(dm_part_ptr + pid_m * N + cols, acc_dm / nrm, mask=mask_n)
    if HAS_DBIAS:
        tl.store(db_part_ptr + pid_m * N + cols, acc_db, mask=mask_n)


def scale_reduce(
    dy: torch.Tensor,
    saved: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    *,
    recover: bool,
    dropout: bool,
    need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """One pass over dy [T, d_out]. Returns (dy_g, dy_g1 or None, dm fp32 [d_out],
    dbias fp32 [d_out] or None). ``saved`` is inner, or y when ``recover``."""
    check_launchable(dy, saved)
    magnitude, norm = unit_stride(magnitude, norm)
    M, N = dy.shape
    dyg = torch.empty((M, N), dtype=dy.dtype, device=dy.device)
    dyg1 = torch.empty_like(dyg) if dropout else None
    if M == 0 or N == 0:
        zeros = torch.zeros(N, dtype=torch.float32, device=dy.device)
        return dyg, dyg1, zeros, (zeros.clone() if need_dbias else None)
    bm = config.interp_small(config.BWD_BLOCK_M)
    bn = config.interp_small(config.BWD_BLOCK_N, 32)
    rpp = max(bm, config.interp_small(config.BWD_ROWS_PER_PROGRAM, 64))
    parts = triton.cdiv(M, rpp)
    dm_part = torch.empty((parts, N), dtype=torch.float32, device=dy.device)
    db_part = torch.empty_like(dm_part) if need_dbias else dm_part
    grid = (parts, triton.cdiv(N, bn))
    _scale_reduce_kernel[grid](
        dy,
        saved,
        magnitude,
        norm,
        dyg,
        dyg1 if dropout else dyg,
        dm_part,
        db_part,
        M,
        N,
        rpp,
        dy.stride(0),
        dy.stride(1),
        saved.stride(0),
        saved.stride(1),
        dyg.stride(0),
        dyg.stride(1),
        config.EPS,
        torch.finfo(dy.dtype).max,
        RECOVER=recover,
        DROPOUT=dropout,
        HAS_DBIAS=need_dbias,
        BLOCK_M=bm,
        BLOCK_N=bn,
        num_warps=config.BWD_WARPS,
    )
    if parts == 1:  # one token chunk: the partial sums are the sums (saves a launch each)
        return dyg, dyg1, dm_part[0], (db_part[0] if need_dbias else None)
    return dyg, dyg1, dm_part.sum(0), (db_part.sum(0) if need_dbias else None)


@triton.jit
def _zero_magnitude_dm_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    h_ptr,
    lb_ptr,
    m_ptr,
    n_ptr,
    dm_ptr,
    M,
    D,
    R,
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xd,
    stride_wn,
    stride_wd,
    stride_hm,
    stride_hr,
    stride_lbn,
    stride_lbr,
    s,
    eps,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """dm_i = Σ_t dy_ti (x_t·W_i + s·h_t·B_i) / max(n_i, eps) for a row i with m_i = 0.

    One program per output row; rows with m_i ≠ 0 run zero loop iterations and store
    nothing, so the kernel costs a launch unless a magnitude is exactly zero — no host sync.
    """
    i = tl.program_id(0)
    mag = tl.load(m_ptr + i).to(tl.float32)
    n_tokens = tl.where(mag == 0.0, M, 0)
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for t0 in range(0, n_tokens, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        mask_t = ts < M
        inner = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            mask_d = ds < D
            xt = tl.load(
                x_ptr + ts[:, None] * stride_xm + ds[None, :] * stride_xd,
                mask=mask_t[:, None] & mask_d[None, :],
                other=0.0,
            ).to(tl.float32)
            w = tl.load(w_ptr + i * stride_wn + ds * stride_wd, mask=mask_d, other=0.0)
            inner += tl.sum(xt * w.to(tl.float32)[None, :], axis=1)
        for r0 in range(0, R, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            mask_r = rs < R
            ht = tl.load(
                h_ptr + ts[:, None] * stride_hm + rs[None, :] * stride_hr,
                mask=mask_t[:, None] & mask_r[None, :],
                other=0.0,
            ).to(tl.float32)
            b = tl.load(lb_ptr + i * stride_lbn + rs * stride_lbr, mask=mask_r, other=0.0)
            inner += s * tl.sum(ht * b.to(tl.float32)[None, :], axis=1)
        dy = tl.load(dy_ptr + ts * stride_dym + i * stride_dyn, mask=mask_t, other=0.0)
        acc += dy.to(tl.float32) * inner
    nrm = tl.maximum(tl.load(n_ptr + i).to(tl.float32), eps)
    # Store only for zero-magnitude rows (a scalar store masked by a scalar condition).
    tl.store(dm_ptr + i, tl.sum(acc, axis=0) / nrm, mask=mag == 0.0)


def zero_magnitude_dm(
    dm: torch.Tensor,
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    h: torch.Tensor,
    lora_B: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Overwrite dm (fp32 [d_out], in place) at rows with magnitude exactly 0, where inner
    could not be recovered from y = 0·inner. x [T, d_in], weight [d_out, d_in], h [T, r],
    lora_B [d_out, r] (activation dtype), dy [T, d_out]."""
    check_launchable(dy, x, weight)
    magnitude, norm = unit_stride(magnitude, norm)
    M, D = x.shape
    N, R = lora_B.shape
    if M == 0 or N == 0:
        return dm
    bt = config.interp_small(config.ZERO_MAG_BLOCK_T)
    bd = config.interp_small(config.ZERO_MAG_BLOCK_D)
    br = (
        min(16, triton.next_power_of_2(R))
        if config.interpreting()
        else triton.next_power_of_2(min(R, 64))
    )
    _zero_magnitude_dm_kernel[(N,)](
        dy,
        x,
        weight,
        h,
        lora_B,
        magnitude,
        norm,
        dm,
        M,
        D,
        R,
        dy.stride(0),
        dy.stride(1),
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        h.stride(0),
        h.stride(1),
        lora_B.stride(0),
        lora_B.stride(1),
        float(scaling),
        config.EPS,
        BLOCK_T=bt,
        BLOCK_D=bd,
        BLOCK_R=br,
        num_warps=config.ZERO_MAG_WARPS,
    )
    return dm
