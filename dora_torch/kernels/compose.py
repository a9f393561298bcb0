"""Forward composition kernels.

DoRA output, with g = m / max(n, eps) per output column (fp32), s the adapter scale:

    no dropout:  inner = base + s·lora      y = g ⊙ inner + b
    dropout:     inner = base_d + s·lora_d  y = base + (g − 1) ⊙ base_d + g·s ⊙ lora_d + b

where base = x Wᵀ, base_d = x_d Wᵀ (x_d = dropout(x)), lora = h Bᵀ with h = x_d Aᵀ. Every
operand is upcast to fp32 on load, g − 1 is formed as (m − n)/n in fp32 (docs/design.md §3: in bf16
it cancels catastrophically) and y is rounded once, on store. ``inner`` is optionally stored
for the backward's magnitude gradient.

Two kernels share that epilogue:
- ``_lora_gemm_compose_kernel``: computes ``lora = h @ Bᵀ`` tile by tile (K = r) and applies
  the epilogue in registers, so ``lora`` is never written to memory;
- ``_compose_kernel``: the elementwise pass, for when ``lora`` comes from cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import config
from .common import cdiv, check_launchable, dot_fp32, dot_precision, next_pow2, unit_stride
from .launch import Launcher


@triton.jit
def _epilogue(
    lora,  # [BLOCK_M, BLOCK_N] fp32, the adapter product h Bᵀ (unscaled)
    rows,
    cols,
    M,
    N,
    base_ptr,  # x Wᵀ  (only read with DROPOUT)
    based_ptr,  # x_d Wᵀ (equals x Wᵀ without dropout)
    stride_bm,
    stride_bn,
    m_ptr,
    n_ptr,
    bias_ptr,
    y_ptr,
    stride_ym,
    stride_yn,
    inner_ptr,
    stride_im,
    stride_in,
    s,
    eps,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    STORE_INNER: tl.constexpr,
):
    mask_n = cols < N
    mask = (rows < M)[:, None] & mask_n[None, :]
    mag = tl.load(m_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)
    nrm = tl.maximum(tl.load(n_ptr + cols, mask=mask_n, other=1.0).to(tl.float32), eps)
    g = mag / nrm
    boff = rows[:, None] * stride_bm + cols[None, :] * stride_bn
    base_d = tl.load(based_ptr + boff, mask=mask, other=0.0).to(tl.float32)
    inner = base_d + s * lora
    if DROPOUT:
        base = tl.load(base_ptr + boff, mask=mask, other=0.0).to(tl.float32)
        y = base + ((mag - nrm) / nrm)[None, :] * base_d + (g * s)[None, :] * lora
    else:
        y = g[None, :] * inner
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if STORE_INNER:
        ioff = rows[:, None] * stride_im + cols[None, :] * stride_in
        tl.store(inner_ptr + ioff, inner.to(inner_ptr.dtype.element_ty), mask=mask)
    yoff = rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptr + yoff, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_gemm_compose_kernel(
    h_ptr,  # [M, K]
    lb_ptr,  # lora_B [N, K]
    base_ptr,
    based_ptr,
    m_ptr,
    n_ptr,
    bias_ptr,
    y_ptr,
    inner_ptr,
    M,
    N,
    K,
    stride_hm,
    stride_hk,
    stride_lbn,
    stride_lbk,
    stride_bm,
    stride_bn,
    stride_ym,
    stride_yn,
    stride_im,
    stride_in,
    s,
    EPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    STORE_INNER: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """y = epilogue(h @ Bᵀ) for one [BLOCK_M, BLOCK_N] tile; see the module docstring.

    Grouped tile order (GROUP_M row tiles share B column tiles in L2). The K loop runs over
    r; masked loads pad r up to BLOCK_K ≥ 16 with zeros (tl.dot's minimum).
    """
    # Scalars arrive as fp64 when Inductor launches the kernel: keep the math in fp32.
    s = tl.cast(s, tl.float32)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows < M
    mask_n = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < K
        a = tl.load(
            h_ptr + rows[:, None] * stride_hm + ks[None, :] * stride_hk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            lb_ptr + cols[None, :] * stride_lbn + ks[:, None] * stride_lbk,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    _epilogue(
        acc,
        rows,
        cols,
        M,
        N,
        base_ptr,
        based_ptr,
        stride_bm,
        stride_bn,
        m_ptr,
        n_ptr,
        bias_ptr,
        y_ptr,
        stride_ym,
        stride_yn,
        inner_ptr,
        stride_im,
        stride_in,
        s,
        EPS,
        HAS_BIAS,
        DROPOUT,
        STORE_INNER,
    )


@triton.jit
def _compose_kernel(
    lora_ptr,
    base_ptr,
    based_ptr,
    m_ptr,
    n_ptr,
    bias_ptr,
    y_ptr,
    inner_ptr,
    stride_lm,
    stride_ln,
    M,
    N,
    stride_bm,
    stride_bn,
    stride_ym,
    stride_yn,
    stride_im,
    stride_in,
    s,
    EPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    STORE_INNER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Elementwise composition of one tile: reads base (and base_d), lora; writes y once."""
    # Scalars arrive as fp64 when Inductor launches the kernel: keep the math in fp32.
    s = tl.cast(s, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    lora = tl.load(
        lora_ptr + rows[:, None] * stride_lm + cols[None, :] * stride_ln, mask=mask, other=0.0
    ).to(tl.float32)
    _epilogue(
        lora,
        rows,
        cols,
        M,
        N,
        base_ptr,
        based_ptr,
        stride_bm,
        stride_bn,
        m_ptr,
        n_ptr,
        bias_ptr,
        y_ptr,
        stride_ym,
        stride_yn,
        inner_ptr,
        stride_im,
        stride_in,
        s,
        EPS,
        HAS_BIAS,
        DROPOUT,
        STORE_INNER,
    )


_launch_lora_gemm_compose = Launcher(_lora_gemm_compose_kernel)
_launch_compose = Launcher(_compose_kernel)


def compose_forward(
    h: torch.Tensor,
    lora_B: torch.Tensor,
    base_d: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    *,
    base: torch.Tensor | None = None,
    store_inner: bool = False,
    epilogue: bool | None = None,
    gemm_config: config.GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused DoRA composition. Returns (y, inner or None).

    h [T, r] and lora_B [d_out, r] in the activation dtype; base_d = x_d Wᵀ [T, d_out] (the
    base product of the adapter's input; x Wᵀ without dropout); base = x Wᵀ [T, d_out] only on
    the dropout path (None otherwise); magnitude [d_out] any float dtype; norm [d_out] fp32;
    bias [d_out] or None. y [T, d_out] has base_d's dtype. The base buffers must belong to
    the caller (fresh GEMM outputs): y is written IN PLACE over base (dropout) or base_d, and
    with ``store_inner`` the fp32 ``inner = base_d + s·lora`` is rounded to base_d's dtype and
    written in place over base_d — so neither costs a new allocation, except y when inner is
    kept without dropout.
    ``epilogue`` (default ``config.COMPOSE_IN_GEMM_EPILOGUE``) picks the GEMM-epilogue kernel
    or cuBLAS ``h @ Bᵀ`` + the elementwise kernel; ``gemm_config`` overrides the epilogue
    GEMM's tiles (default ``config.lora_gemm_config``; the benchmark sweeps candidates).
    """
    check_launchable(h, base_d, base)
    magnitude, norm, bias = unit_stride(magnitude, norm, bias)
    M, N = base_d.shape
    K = h.shape[1]
    dropout = base is not None
    if dropout and base.stride() != base_d.stride():
        raise ValueError("base and base_d must have the same strides")
    # y overwrites a base product in place (each tile is read, then written, by one program):
    # no [T, d_out] allocation beyond what cuBLAS produced. Only when inner must be kept in
    # base_d and there is no separate base (no dropout) does y need its own buffer.
    if dropout:
        y = base
    elif store_inner:
        y = torch.empty((M, N), dtype=base_d.dtype, device=base_d.device)
    else:
        y = base_d
    inner = base_d if store_inner else None
    if M == 0 or N == 0:
        return y, inner
    base_arg = base if dropout else base_d
    inner_arg = base_d  # a valid pointer even when unused (STORE_INNER=False)
    bias_arg = bias if bias is not None else norm
    use_epilogue = config.COMPOSE_IN_GEMM_EPILOGUE if epilogue is None else epilogue
    if use_epilogue:
        cfg = gemm_config or config.lora_gemm_config(
            M, N, K, store_inner=store_inner, dropout=dropout
        )
        block_k = max(16, min(cfg.block_k, next_pow2(K)))
        grid = (cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n),)
        _launch_lora_gemm_compose(
            grid,
            h,
            lora_B,
            base_arg,
            base_d,
            magnitude,
            norm,
            bias_arg,
            y,
            inner_arg,
            M,
            N,
            K,
            *h.stride(),
            *lora_B.stride(),
            *base_d.stride(),
            *y.stride(),
            *inner_arg.stride(),
            float(scaling),
            EPS=config.EPS,
            HAS_BIAS=bias is not None,
            DROPOUT=dropout,
            STORE_INNER=store_inner,
            DOT_FP32=dot_fp32(h.dtype),
            DOT_PRECISION=dot_precision(h.dtype),
            BLOCK_K=block_k,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    else:
        lora = torch.mm(h, lora_B.t())
        compose_elementwise(
            lora, base_d, magnitude, norm, scaling, bias, base=base, y=y, store_inner=store_inner
        )
    return y, inner


def compose_elementwise(
    lora: torch.Tensor,
    base_d: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    *,
    base: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
    store_inner: bool = False,
) -> torch.Tensor:
    """The one-pass compose kernel: y = g ⊙ (base_d + s·lora) + b (or the dropout form).

    lora, base_d (and base) [T, d_out] in the activation dtype; returns y (written into ``y``
    if given). With ``store_inner``, inner overwrites base_d in place.
    """
    check_launchable(lora)
    magnitude, norm, bias = unit_stride(magnitude, norm, bias)
    M, N = base_d.shape
    if y is None:
        y = torch.empty((M, N), dtype=base_d.dtype, device=base_d.device)
    if M == 0 or N == 0:
        return y
    base_arg = base if base is not None else base_d
    if base_arg.stride() != base_d.stride():
        raise ValueError("base and base_d must have the same strides")
    bm = config.interp_small(config.COMPOSE_BLOCK_M)
    bn = config.interp_small(config.COMPOSE_BLOCK_N, 32)
    grid = (cdiv(M, bm), cdiv(N, bn))
    _launch_compose(
        grid,
        lora,
        base_arg,
        base_d,
        magnitude,
        norm,
        bias if bias is not None else norm,
        y,
        base_d,
        *lora.stride(),
        M,
        N,
        *base_d.stride(),
        *y.stride(),
        *base_d.stride(),
        float(scaling),
        EPS=config.EPS,
        HAS_BIAS=bias is not None,
        DROPOUT=base is not None,
        STORE_INNER=store_inner,
        BLOCK_M=bm,
        BLOCK_N=bn,
        num_warps=config.COMPOSE_WARPS,
    )
    return y
