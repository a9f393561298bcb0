"""Adapter initialisation, as PEFT does it (transposed to Flax layout)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def lora_a_init(key, shape, dtype=jnp.float32):
    """PEFT's ``kaiming_uniform_(a=sqrt(5))`` on lora_A [r, d_in], in Flax layout [d_in, r].

    With a = sqrt(5) the gain is sqrt(1/3), so the bound is gain·sqrt(3 / fan_in) = 1/sqrt(d_in).
    """
    d_in, _ = shape
    bound = 1.0 / math.sqrt(d_in)
    return jax.random.uniform(key, shape, dtype, minval=-bound, maxval=bound)


def lora_b_init(key, shape, dtype=jnp.float32):
    """Zeros: a fresh adapter adds nothing (and, with m = n, reproduces the base layer)."""
    del key
    return jnp.zeros(shape, dtype)
