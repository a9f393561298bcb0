"""The one helper that checks dora_dense's output and every gradient against shared_spec."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import shared_spec as S
from dora_jax.baselines import naive_dora_dense
from dora_jax.functional import dora_dense
from shared_spec.cases import Case
from shared_spec.compose import EPS
from shared_spec.tolerances import assert_close


def _cast(v, dtype):
    return None if v is None else jnp.asarray(v, dtype)


def f64(v):
    """float64 NumPy copy of an array (None stays None)."""
    return None if v is None else np.asarray(jnp.asarray(v, jnp.float32), np.float64)


def naive_exact_dora_dense(x, kernel, lora_a, lora_b, magnitude, scaling, bias=None):
    """``naive_dora_dense(..., exact_norm_grad=True)`` with the eps clamp on n² (EPS²) before
    the square root instead of on n after it, as the torch baseline does: the same values, but
    at a zero column the gradient is 0 rather than sqrt'(0)·0 = NaN, which would leave the
    tolerance rule without a finite bound (zero_base_row)."""
    dt = x.dtype
    w = kernel.astype(dt) + scaling * (lora_a.astype(dt) @ lora_b.astype(dt))
    sq = jnp.sum(jnp.square(w.astype(jnp.float32)), axis=0)
    n = jnp.sqrt(jnp.maximum(sq, EPS * EPS))
    g = (magnitude.astype(jnp.float32) / n).astype(dt)
    y = g * (x @ w)
    return y if bias is None else y + bias.astype(dt)


def _value_and_vjp(f, args, dy):
    @jax.jit
    def run(args, dy):
        y, pull = jax.vjp(f, *args)
        return y, pull(dy)

    return run(args, dy)


def check_case(case: Case, dtype, *, impl: str, exact_norm_grad: bool = False, seed: int = 0):
    """Forward and VJP (random cotangent) of ``dora_dense`` vs the float64 spec.

    All inputs are cast to ``dtype`` first and the spec runs on the cast values; the baseline
    is naive dense jnp DoRA in the same dtype (``shared_spec.tolerances`` rule).
    """
    d = case.make(seed)
    kernel, lora_a, lora_b = S.to_flax_layout(d.W, d.A, d.B)
    inputs = [_cast(v, dtype) for v in (d.x, kernel, lora_a, lora_b, d.m, d.bias)]
    x, k, a, b, m, bias = inputs
    dy = _cast(d.dy, dtype)
    s = d.scaling

    W, A, B = S.from_flax_layout(f64(k), f64(a), f64(b))
    ref_y = S.dora_linear(f64(x), W, A, B, f64(m), s, f64(bias))
    ref = S.dora_linear_vjp(
        f64(x), W, A, B, f64(m), s, f64(dy), f64(bias), exact_norm_grad=exact_norm_grad
    )

    def ours(x, a, b, m, bias):
        return dora_dense(x, k, a, b, m, s, bias, impl=impl, exact_norm_grad=exact_norm_grad)

    def naive(x, a, b, m, bias):
        if exact_norm_grad:
            return naive_exact_dora_dense(x, k, a, b, m, s, bias)
        return naive_dora_dense(x, k, a, b, m, s, bias)

    # one jit per function: far fewer compilations than op-by-op eager dispatch
    y, grads = _value_and_vjp(ours, (x, a, b, m, bias), dy)
    y0, grads0 = _value_and_vjp(naive, (x, a, b, m, bias), dy)
    assert y.dtype == x.dtype and y.shape == ref_y.shape
    for g, primal in zip(grads, (x, a, b, m, bias)):
        assert (g is None) == (primal is None)
        assert g is None or (g.shape == primal.shape and g.dtype == primal.dtype)

    eps = float(jnp.finfo(dtype).eps)
    # f32: a floor of one ulp instead of the default quarter: the factored backward associates
    # the products differently from the dense baseline (xᵀ(dy_g·bᵀ) vs (xᵀ·dy_g)·bᵀ), and on a
    # result of a few dozen f32 elements (one_token) that alone moves the error by ~1 ulp.
    # bf16 keeps the shared default (a quarter ulp): its baseline error dominates anyway.
    floor = eps if jnp.dtype(dtype) == jnp.float32 else None
    tag = f"{case.name}/{jnp.dtype(dtype).name}/{impl}/exact={exact_norm_grad}"
    assert_close(f64(y), ref_y, f64(y0), machine_eps=eps, floor=floor, name=f"{tag} y")
    names = ("dx", "dA", "dB", "dm", "dbias")
    refs = (ref.dx, ref.dA.T, ref.dB.T, ref.dm, ref.dbias)  # dA, dB back to Flax layout
    for name, g, g0, r in zip(names, grads, grads0, refs):
        if r is None:
            continue
        assert_close(f64(g), r, f64(g0), machine_eps=eps, floor=floor, name=f"{tag} {name}")
