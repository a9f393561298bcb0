"""The memory-bound parts of DoRA in XLA (norm assembly, compose, scale-and-reduce; on Hopper
``dora_jax.mosaic`` can fuse the compose instead), and the one definition of the magnitude
factor g = m / max(n, eps) and of g − 1 = (m − n)/n.

Written so XLA fuses each into the GEMM next to it or into one elementwise pass: activations stay
in their dtype, only the per-column quantities (g, norms, sums) are in the accumulation dtype
``acc = promote_types(f32, activation dtype)`` (f32, or f64 for f64 activations; docs/design.md §5).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from shared_spec.compose import EPS

from .config import acc_dtype


def safe_norm(norm, dtype):
    """max(n, eps) in ``dtype``: the clamped norm every division by n uses (the spec's eps)."""
    return jnp.maximum(norm.astype(dtype), EPS)


def norm_is_clamped(norm):
    """True where n < eps: there g is m/eps and nothing flows through n (exact norm gradient)."""
    return norm < EPS


def magnitude_scale(magnitude, norm, dtype):
    """g = m / max(n, eps) in ``dtype`` [d_out]."""
    return magnitude.astype(dtype) / safe_norm(norm, dtype)


def magnitude_scale_minus_one(magnitude, norm, dtype):
    """g − 1 = (m − n) / max(n, eps) in ``dtype`` [d_out]: never g − 1 after rounding g (§3)."""
    n = safe_norm(norm, dtype)
    return (magnitude.astype(dtype) - n) / n


def saturating_scale(dy, g, acc):
    """``g ⊙ dy`` per column, evaluated in ``acc`` and rounded to dy's dtype, saturated to
    ±finfo(dy.dtype).max instead of overflowing to ±inf.

    With a zero column (n clamped to eps) g ≈ m/eps; in f16 g·dy overflows, and inf · 0 in the
    following GEMMs (that column of K and b is zero) would turn dx and da into NaN. dora_torch
    saturates the same way (``ops.backward_core``).
    """
    big = float(jnp.finfo(dy.dtype).max)
    scaled = dy.astype(acc) * g.astype(acc)[None, :]
    return jnp.clip(scaled, -big, big).astype(dy.dtype)


def compose(base, h, lora_b, g, bias=None, *, scaling: float, precision=None, dropout=None):
    """``g ⊙ (base + s·h·lora_b) + bias``; returns (y, inner).

    inner = base + s·h·lora_b [T, N] is rounded to the activation dtype (XLA folds the add into
    the LoRA GEMM); the scale by g and the bias run in acc and round once. The backward saves
    ``inner``: its buffer replaces base's, so the forward holds one [T, N] temporary, as LoRA.

    With adapter dropout (PEFT's form, docs/design.md §1), ``dropout = (base_d, g1)`` with
    base_d = x_d·K and g1 = (m − n)/n in acc (never g − 1 in the activation dtype), and h = x_d·a:

        y = base + g1 ⊙ base_d + g ⊙ s·h·lora_b + bias,   inner = base_d + s·h·lora_b
    """
    acc = acc_dtype(base.dtype)
    g = g.astype(acc)
    lora = jnp.dot(h, lora_b, precision=precision)
    if dropout is None:
        inner = base + (scaling * lora).astype(base.dtype)
        y = g[None, :] * inner.astype(acc)
    else:
        base_d, g1 = dropout
        inner = base_d + (scaling * lora).astype(base.dtype)
        y = (
            base.astype(acc)
            + g1.astype(acc)[None, :] * base_d.astype(acc)
            + (scaling * g)[None, :] * lora.astype(acc)
        )
    if bias is not None:
        y = y + bias.astype(acc)[None, :]
    return y.astype(base.dtype), inner


def scale_reduce(dy, saved, g):
    """(g ⊙ dy in dy's dtype, saturated; Σ_t dy ⊙ saved in acc): one elementwise pass with a
    column sum."""
    acc = acc_dtype(dy.dtype)
    col = jnp.sum(dy.astype(acc) * saved.astype(acc), axis=0)
    return saturating_scale(dy, g, acc), col


def gram_times_b(gram, lora_b, *, precision=None, bf16x3: bool = False):
    """G·b [r, N] in promote(G, b) (the Gram term of the norm; the exact norm gradient reuses it).

    lora_b is taken at promote(b.dtype, f32): never rounded below f32. With ``bf16x3`` (a
    16-bit kernel, f32 assembly: ``config.norm_gemm_bf16x3``) the product runs on the tensor
    cores from bf16 pairs, G = G_hi + G_lo and b = b_hi + b_lo, as one GEMM over the stacked
    contraction [G_hi | G_hi | G_lo] · [b_hi; b_lo; b_hi] with f32 accumulation (the lo·lo
    term dropped; a bf16 b has no lo part, so two blocks). Every entry is then within
    3·2⁻¹⁶ Σ_k |G_ik| |b_kj| (plus f32 accumulation) of the exact product: far below the
    2⁻⁸ / 2⁻¹¹ rounding of a 16-bit layer's output, where the f32 GEMM runs on the CUDA cores
    (docs/design.md §5; dora_torch's ``bg_bf16x3`` is the same product).
    """
    dt = acc_dtype(gram.dtype, lora_b.dtype)
    if not bf16x3:
        return jnp.dot(
            gram.astype(dt), lora_b.astype(dt), precision=precision, preferred_element_type=dt
        )
    if dt != jnp.float32:
        raise ValueError(f"bf16x3 needs an f32 assembly; got {dt}")
    g_hi, g_lo = _bf16_pair(gram.astype(dt))
    if lora_b.dtype == jnp.bfloat16:
        left, right = (g_hi, g_lo), (lora_b, lora_b)
    else:
        b_hi, b_lo = _bf16_pair(lora_b.astype(dt))
        left, right = (g_hi, g_hi, g_lo), (b_hi, b_lo, b_hi)
    return jnp.dot(
        jnp.concatenate(left, axis=1), jnp.concatenate(right, axis=0), preferred_element_type=dt
    )


def _bf16_pair(x):
    """(hi, lo) in bf16 with hi + lo = x to within 2⁻¹⁶|x|: hi is x rounded to nearest bf16
    by ``reduce_precision`` (an op XLA keeps, unlike an f32 → bf16 → f32 round trip, which
    its excess-precision rewrites may drop), so x − hi is exact in f32 and only lo rounds."""
    hi = lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def norm_from_gb(u, gb, lora_b, base_sq, *, scaling: float):
    """n_j = sqrt(max(base_sq_j + Σ_k b_kj (2s·U_kj + s²·(G b)_kj), 0)) from a given G·b,
    in promote(f32, u, G·b, b, base_sq)."""
    dt = acc_dtype(u.dtype, gb.dtype, lora_b.dtype, base_sq.dtype)
    b = lora_b.astype(dt)
    cross_gram = 2.0 * scaling * u.astype(dt) + scaling * scaling * gb.astype(dt)
    sq = base_sq.astype(dt) + jnp.sum(b * cross_gram, axis=0)
    return jnp.sqrt(jnp.maximum(sq, 0.0))
