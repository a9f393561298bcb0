"""Plain-jnp layers the tests and benchmarks measure against (not used by the library itself).

``naive_dora_dense`` is DoRA as most code writes it: it builds the dense K + s·a·b and runs
everything in the activation dtype. ``lora_dense`` is the LoRA layer with the same shapes, the
cost DoRA should match.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shared_spec.compose import EPS


def naive_dora_dense(
    x, kernel, lora_a, lora_b, magnitude, scaling, bias=None, *, exact_norm_grad=False
):
    """Dense DoRA in x's dtype. x [..., d_in], kernel [d_in, d_out], lora_a [d_in, r],
    lora_b [r, d_out], magnitude/bias [d_out]. The norm is detached unless exact_norm_grad."""
    dt = x.dtype
    w = kernel.astype(dt) + scaling * (lora_a.astype(dt) @ lora_b.astype(dt))
    n = jnp.sqrt(jnp.sum(jnp.square(w.astype(jnp.float32)), axis=0))
    if not exact_norm_grad:
        n = jax.lax.stop_gradient(n)
    g = (magnitude.astype(jnp.float32) / jnp.maximum(n, EPS)).astype(dt)
    y = g * (x @ w)
    return y if bias is None else y + bias.astype(dt)


def lora_dense(x, kernel, lora_a, lora_b, scaling, bias=None):
    """LoRA in x's dtype: x·K + s·(x·a)·b + bias."""
    dt = x.dtype
    y = x @ kernel.astype(dt) + (x @ lora_a.astype(dt)) @ (scaling * lora_b).astype(dt)
    return y if bias is None else y + bias.astype(dt)
