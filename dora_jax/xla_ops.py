"""XLA counterparts of the Pallas kernels in ``dora_jax.kernels`` (same math, same shapes).

Written so XLA fuses each into the GEMM next to it or into one elementwise pass: activations stay
in their dtype, only the per-column quantities (g, norms, sums) are f32 (DESIGN §5).
"""

from __future__ import annotations

import jax.numpy as jnp

_F32 = jnp.float32


def compose(base, h, lora_b, g, bias=None, *, scaling: float, precision=None, dropout=None):
    """``g ⊙ (base + s·h·lora_b) + bias``; returns (y, inner).

    inner = base + s·h·lora_b [T, N] is rounded to the activation dtype (XLA folds the add into
    the LoRA GEMM); the scale by g and the bias run in f32 and round once. The backward saves
    ``inner``: its buffer replaces base's, so the forward holds one [T, N] temporary, as LoRA.

    With adapter dropout (PEFT's form, DESIGN §1), ``dropout = (base_d, g1)`` with
    base_d = x_d·K and g1 = (m − n)/n in f32 (never g − 1 in the activation dtype), and h = x_d·a:

        y = base + g1 ⊙ base_d + g ⊙ s·h·lora_b + bias,   inner = base_d + s·h·lora_b
    """
    lora = jnp.dot(h, lora_b, precision=precision)
    if dropout is None:
        inner = base + (scaling * lora).astype(base.dtype)
        y = g[None, :] * inner.astype(_F32)
    else:
        base_d, g1 = dropout
        inner = base_d + (scaling * lora).astype(base.dtype)
        y = (
            base.astype(_F32)
            + g1[None, :] * base_d.astype(_F32)
            + (scaling * g)[None, :] * lora.astype(_F32)
        )
    if bias is not None:
        y = y + bias.astype(_F32)[None, :]
    return y.astype(base.dtype), inner


def scale_reduce(dy, saved, g):
    """(g ⊙ dy in dy's dtype, Σ_t dy ⊙ saved in f32): one elementwise pass with a column sum."""
    dy32 = dy.astype(_F32)
    return (dy32 * g[None, :]).astype(dy.dtype), jnp.sum(dy32 * saved.astype(_F32), axis=0)


def gram_times_b(gram, lora_b, *, precision=None):
    """G·b [r, N] in f32 (the Gram term of the norm; the exact norm gradient reuses it)."""
    b = lora_b.astype(_F32)
    return jnp.dot(gram.astype(_F32), b, precision=precision, preferred_element_type=_F32)


def norm_from_gb(u, gb, lora_b, base_sq, *, scaling: float):
    """n_j = sqrt(max(base_sq_j + Σ_k b_kj (2s·U_kj + s²·(G b)_kj), 0)) from a given G·b."""
    b = lora_b.astype(_F32)
    sq = base_sq.astype(_F32) + jnp.sum(b * (2.0 * scaling * u + scaling * scaling * gb), axis=0)
    return jnp.sqrt(jnp.maximum(sq, 0.0))


def norm_assembly(u, gram, lora_b, base_sq, *, scaling: float, precision=None):
    """n_j = sqrt(max(base_sq_j + Σ_k b_kj (2s·U_kj + s²·(G b)_kj), 0)), f32 [N]."""
    gb = gram_times_b(gram, lora_b, precision=precision)
    return norm_from_gb(u, gb, lora_b, base_sq, scaling=scaling)
