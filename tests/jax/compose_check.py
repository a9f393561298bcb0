"""One check of a fused compose kernel, y = g ⊙ (base + s·h·b) + bias, against float64 (the
shared tolerance rule, with XLA's compose in the same dtype as the baseline), and the layer
cases whose shapes the Mosaic compose tiles (tokens a multiple of 64, d_out of 128)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax import xla_ops
from shared_spec.cases import Case
from shared_spec.tolerances import assert_close

from .spec_check import f64

MOSAIC_CASES = [
    Case("mosaic_aligned", d_in=48, d_out=128, r=8, lead=(64,)),
    Case("mosaic_3d_no_bias", d_in=40, d_out=256, r=24, lead=(2, 64), bias=False),
    Case("mosaic_zero_rows", d_in=32, d_out=128, r=4, lead=(64,), zero_rows=(0, 5)),
]
MOSAIC_ZERO_ROWS = MOSAIC_CASES[2]


def compose_operands(tokens, d_out, rank, dtype, *, bias=True, seed=0):
    """(base, h, b, g, bias); g is zero at column 3 (m = 0: y is the bias there)."""
    keys = jax.random.split(jax.random.key(seed), 5)
    base = jax.random.normal(keys[0], (tokens, d_out), dtype)
    h = jax.random.normal(keys[1], (tokens, rank), dtype)
    b = (jax.random.normal(keys[2], (rank, d_out)) / max(rank, 1) ** 0.5).astype(dtype)
    g = (0.5 + jax.random.uniform(keys[3], (d_out,))).at[3].set(0.0)
    bias_v = jax.random.normal(keys[4], (d_out,), dtype) if bias else None
    return base, h, b, g, bias_v


def check_compose(compose, tokens, d_out, rank, dtype, *, bias=True, scaling=1.7):
    """``compose(base, h, b, g, bias, scaling=)`` against float64."""
    base, h, b, g, bias_v = compose_operands(tokens, d_out, rank, dtype, bias=bias)
    y = compose(base, h, b, g, bias_v, scaling=scaling)
    assert y.dtype == base.dtype and y.shape == base.shape
    ref = f64(g) * (f64(base) + scaling * (f64(h) @ f64(b)))
    if bias:
        ref = ref + f64(bias_v)
    y0, _ = xla_ops.compose(base, h, b, g, bias_v, scaling=scaling, precision=None)
    eps = float(jnp.finfo(dtype).eps)
    assert_close(f64(y), ref, f64(y0), machine_eps=eps, name=f"compose {tokens}x{d_out} r={rank}")
    if bias:
        np.testing.assert_array_equal(f64(y)[:, 3], f64(bias_v)[3])
