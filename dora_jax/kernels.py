"""Pallas kernels (Triton lowering) for the memory-bound parts of DoRA, and their launchers.

The big GEMMs (x·K, x·a, U = aᵀK, the backward's dy·Kᵀ) stay in XLA/cuBLAS; these kernels fuse
what sits around them. Every kernel reads and writes through ``plt.load``/``plt.store`` with
explicit masks, because on the GPU edge blocks are not masked for us (docs/design.md §7);
all in-kernel
arrays have power-of-two shapes, dots have every dimension >= 16 (LoRA ranks below 16 are padded
with masked zeros), and f32 dots get an explicit precision. This module is the only place that
calls ``pallas_call``, so a Mosaic GPU version can replace it wholesale.

Shapes (Flax layout): tokens T, d_out N, rank r. All launchers accept T = 0.

"f32" below is the accumulation dtype acc = promote_types(f32, activation dtype): f32 for
bf16/f16/f32 activations, f64 for f64 ones (with ``jax_enable_x64``; interpret mode on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .config import DEFAULT_BLOCKS, BlockConfig, acc_dtype


def _span(block_index, block: int, size: int):
    """Indices of one block along an axis, and the mask of those inside ``size``."""
    idx = block_index * block + jnp.arange(block)
    return idx, idx < size


# --------------------------------------------------------------------------------------------
# compose: y = g ⊙ (base + s·h b) + bias
# --------------------------------------------------------------------------------------------


def _compose_kernel(
    base_ref,
    h_ref,
    b_ref,
    g_ref,
    *rest,
    scaling: float,
    has_bias: bool,
    block_t: int,
    block_n: int,
    block_r: int,
    precision,
    acc,
):
    """One [block_t, block_n] tile of the DoRA output.

        y[t, j] = g[j] · (base[t, j] + s · Σ_k h[t, k] b[k, j]) + bias[j]

    base = x·K and h = x·a come from XLA GEMMs in the activation dtype; the LoRA product h·b,
    the scale by g and the bias are evaluated in f32 and rounded once, on the store. The rank
    loop runs in slices of block_r (>= 16); slices past r load zeros, which pads small ranks.
    """
    bias_ref, y_ref = rest if has_bias else (None, rest[0])
    tokens, d_out = base_ref.shape
    rank = h_ref.shape[1]
    rows, row_ok = _span(pl.program_id(0), block_t, tokens)
    cols, col_ok = _span(pl.program_id(1), block_n, d_out)

    def rank_step(kb, total):
        ks, k_ok = _span(kb, block_r, rank)
        h = plt.load(
            h_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        b = plt.load(
            b_ref.at[ks[:, None], cols[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        return total + jnp.dot(h, b, preferred_element_type=acc, precision=precision)

    lora = lax.fori_loop(0, pl.cdiv(rank, block_r), rank_step, jnp.zeros((block_t, block_n), acc))
    tile_ok = row_ok[:, None] & col_ok[None, :]
    base = plt.load(base_ref.at[rows[:, None], cols[None, :]], mask=tile_ok, other=0.0)
    g = plt.load(g_ref.at[cols], mask=col_ok, other=0.0)
    y = g[None, :] * (base.astype(acc) + scaling * lora)
    if has_bias:
        y = y + plt.load(bias_ref.at[cols], mask=col_ok, other=0.0).astype(acc)[None, :]
    plt.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=tile_ok)


def compose(
    base,
    h,
    lora_b,
    g,
    bias=None,
    *,
    scaling: float,
    precision=None,
    config: BlockConfig = DEFAULT_BLOCKS,
    interpret: bool = False,
):
    """``g ⊙ (base + s·h·lora_b) + bias`` in one pass.

    base [T, N] and h [T, r] and lora_b [r, N] in the activation dtype; g [N] (cast to acc);
    bias [N] or None. Returns [T, N] in base's dtype.
    """
    tokens, d_out = base.shape
    if tokens == 0:
        return jnp.zeros_like(base)
    if h.dtype != lora_b.dtype:
        raise ValueError(f"h {h.dtype} and lora_b {lora_b.dtype} must share a dtype for the dot")
    has_bias = bias is not None
    acc = acc_dtype(base.dtype)
    kernel = functools.partial(
        _compose_kernel,
        scaling=float(scaling),
        has_bias=has_bias,
        block_t=config.compose_block_t,
        block_n=config.compose_block_n,
        block_r=config.compose_block_r,
        precision=precision,
        acc=acc,
    )
    args = (base, h, lora_b, g.astype(acc)) + ((bias,) if has_bias else ())
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(base.shape, base.dtype),
        grid=(pl.cdiv(tokens, config.compose_block_t), pl.cdiv(d_out, config.compose_block_n)),
        compiler_params=plt.CompilerParams(
            num_warps=config.compose_num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="dora_compose",
    )(*args)


# --------------------------------------------------------------------------------------------
# scale_reduce: dy_g = g ⊙ dy and Σ_t dy ⊙ saved
# --------------------------------------------------------------------------------------------


def _scale_reduce_kernel(
    dy_ref,
    saved_ref,
    g_ref,
    dyg_ref,
    part_ref,
    *,
    steps: int,
    block_t: int,
    block_n: int,
    acc,
    big: float,
):
    """One column block of the backward's memory-bound pass, over one share of the tokens.

        dy_g[t, j]  = clip(g[j] · dy[t, j], ±big)         (rounded to dy's dtype)
        part[p, j]  = Σ_{t in share p} dy[t, j] · saved[t, j]    (f32)

    big = finfo(dy.dtype).max: g·dy saturates instead of overflowing (a zero column has
    g ≈ m/eps; in f16 inf · 0 would make dx NaN; ``xla_ops.saturating_scale``).
    Program (p, jb) walks ``steps`` token blocks starting at block p·steps; summing ``part``
    over p gives Σ_t dy ⊙ saved, from which dm = (Σ_t dy ⊙ inner) / n.
    """
    tokens, d_out = dy_ref.shape
    share = pl.program_id(0)
    cols, col_ok = _span(pl.program_id(1), block_n, d_out)
    g = plt.load(g_ref.at[cols], mask=col_ok, other=0.0)

    def token_step(i, total):
        rows, row_ok = _span(share * steps + i, block_t, tokens)
        ok = row_ok[:, None] & col_ok[None, :]
        at = (rows[:, None], cols[None, :])
        dy = plt.load(dy_ref.at[at], mask=ok, other=0.0).astype(acc)
        saved = plt.load(saved_ref.at[at], mask=ok, other=0.0).astype(acc)
        dyg = jnp.minimum(jnp.maximum(dy * g[None, :], -big), big)
        plt.store(dyg_ref.at[at], dyg.astype(dyg_ref.dtype), mask=ok)
        return total + jnp.sum(dy * saved, axis=0)

    total = lax.fori_loop(0, steps, token_step, jnp.zeros((block_n,), acc))
    plt.store(part_ref.at[share, cols], total, mask=col_ok)


def scale_reduce(dy, saved, g, *, config: BlockConfig = DEFAULT_BLOCKS, interpret: bool = False):
    """(g ⊙ dy, Σ_t dy ⊙ saved) in one read of dy and saved.

    dy, saved [T, N] (any float dtypes); g [N]. Returns dy_g [T, N] in dy's dtype (saturated at
    ±finfo(dy.dtype).max) and the column sums [N] in acc = promote(f32, dy.dtype).
    """
    tokens, d_out = dy.shape
    if saved.shape != dy.shape:
        raise ValueError(f"saved {saved.shape} must match dy {dy.shape}")
    acc = acc_dtype(dy.dtype)
    if tokens == 0:
        return jnp.zeros_like(dy), jnp.zeros((d_out,), acc)
    block_t, block_n = config.reduce_block_t, config.reduce_block_n
    t_blocks = pl.cdiv(tokens, block_t)
    splits = min(config.reduce_splits, t_blocks)
    steps = pl.cdiv(t_blocks, splits)
    splits = pl.cdiv(t_blocks, steps)  # drop shares that would start past the end
    kernel = functools.partial(
        _scale_reduce_kernel,
        steps=steps,
        block_t=block_t,
        block_n=block_n,
        acc=acc,
        big=float(jnp.finfo(dy.dtype).max),
    )
    dy_g, part = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(dy.shape, dy.dtype),
            jax.ShapeDtypeStruct((splits, d_out), acc),
        ),
        grid=(splits, pl.cdiv(d_out, block_n)),
        compiler_params=plt.CompilerParams(
            num_warps=config.reduce_num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="dora_scale_reduce",
    )(dy, saved, g.astype(acc))
    return dy_g, jnp.sum(part, axis=0)


# --------------------------------------------------------------------------------------------
# norm assembly: n = sqrt(max(||K_:j||² + 2s·Σ_k b U + s²·Σ_k b (G b), 0))
# --------------------------------------------------------------------------------------------


def _norm_kernel(
    u_ref,
    gram_ref,
    b_ref,
    base_sq_ref,
    n_ref,
    *,
    scaling: float,
    block_n: int,
    block_r: int,
    precision,
    acc,
):
    """Column norms of K + s·a·b for one block of d_out columns, from the GEMM results.

        n_j² = base_sq_j + Σ_k b_kj · (2s·U_kj + s²·(G b)_kj),   U = aᵀK [r, N], G = aᵀa [r, r]

    G·b is accumulated in [block_r, block_r] × [block_r, block_n] slices (ranks are not powers
    of two; slices past r load zeros). The sum is clamped at 0 before the square root: rounding
    can push an all-zero column slightly negative.
    """
    rank, d_out = u_ref.shape
    cols, col_ok = _span(pl.program_id(0), block_n, d_out)
    r_blocks = pl.cdiv(rank, block_r)

    def load_rows(ref, kb):
        ks, k_ok = _span(kb, block_r, rank)
        ok = k_ok[:, None] & col_ok[None, :]
        return plt.load(ref.at[ks[:, None], cols[None, :]], mask=ok, other=0.0).astype(acc)

    def row_block(kb, total):
        ks, k_ok = _span(kb, block_r, rank)

        def col_block(lb, gb):
            ls, l_ok = _span(lb, block_r, rank)
            gram = plt.load(
                gram_ref.at[ks[:, None], ls[None, :]], mask=k_ok[:, None] & l_ok[None, :], other=0.0
            )
            return gb + jnp.dot(
                gram, load_rows(b_ref, lb), preferred_element_type=acc, precision=precision
            )

        gb = lax.fori_loop(0, r_blocks, col_block, jnp.zeros((block_r, block_n), acc))
        b = load_rows(b_ref, kb)
        u = load_rows(u_ref, kb)
        return total + jnp.sum(b * (2.0 * scaling * u + scaling * scaling * gb), axis=0)

    total = lax.fori_loop(0, r_blocks, row_block, jnp.zeros((block_n,), acc))
    base_sq = plt.load(base_sq_ref.at[cols], mask=col_ok, other=0.0)
    plt.store(n_ref.at[cols], jnp.sqrt(jnp.maximum(base_sq + total, 0.0)), mask=col_ok)


def norm_assembly(
    u,
    gram,
    lora_b,
    base_sq,
    *,
    scaling: float,
    precision=None,
    config: BlockConfig = DEFAULT_BLOCKS,
    interpret: bool = False,
):
    """Column norms n [N] of K + s·a·b from U = aᵀK [r, N], G = aᵀa [r, r], lora_b [r, N] and
    base_sq = ||K_:j||² [N], all taken at (and n returned in) promote(f32, their dtypes)."""
    d_out = u.shape[1]
    acc = acc_dtype(u.dtype, gram.dtype, lora_b.dtype, base_sq.dtype)
    kernel = functools.partial(
        _norm_kernel,
        scaling=float(scaling),
        block_n=config.norm_block_n,
        block_r=config.norm_block_r,
        precision=precision,
        acc=acc,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((d_out,), acc),
        grid=(pl.cdiv(d_out, config.norm_block_n),),
        compiler_params=plt.CompilerParams(
            num_warps=config.norm_num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="dora_norm_assembly",
    )(u.astype(acc), gram.astype(acc), lora_b.astype(acc), base_sq.astype(acc))
