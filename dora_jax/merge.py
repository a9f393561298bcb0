"""Folding the adapter into the kernel: the one merge helper the nnx and linen layers share."""

from __future__ import annotations

import jax.numpy as jnp

from shared_spec.compose import EPS

from .checks import check_adapter, check_scaling, check_vector
from .norm import factored_norm


def merged_kernel(kernel, lora_a, lora_b, magnitude, scaling, *, norm=None, dtype=None):
    """``g ⊙_cols (K + s·a·b)`` with g = m / max(n, eps): the kernel of the merged nnx.Linear.

    kernel [d_in, d_out], lora_a [d_in, r], lora_b [r, d_out], magnitude [d_out]; ``norm``
    optionally the precomputed f32 column norm. Computed in f32 (it builds the dense [d_in,
    d_out] product once, by design) and returned in ``dtype`` (default: the kernel's).
    """
    _, d_out, _ = check_adapter(kernel, lora_a, lora_b)
    check_vector("magnitude", magnitude, d_out)
    s = check_scaling(scaling)
    if norm is None:
        norm = factored_norm(kernel, lora_a, lora_b, s)
    f32 = jnp.float32
    g = magnitude.astype(f32) / jnp.maximum(norm.astype(f32), EPS)
    w = kernel.astype(f32) + s * (lora_a.astype(f32) @ lora_b.astype(f32))
    return (w * g[None, :]).astype(kernel.dtype if dtype is None else dtype)
