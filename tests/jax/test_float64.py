"""float64 is float64-accurate: with ``jax_enable_x64`` and float64 inputs, the norm, dora_dense
(forward and VJP), DoraDense and the merge compute in promote_types(float32, dtype) = float64.

x64 is switched on only inside each test (the ``x64`` fixture) so no other test sees it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

import shared_spec as S
from dora_jax import DoraDense, DoraParam, factored_norm, merge_weight, unmerge_weight
from dora_jax.functional import dora_dense
from shared_spec.cases import CASES

F64 = jnp.float64
TOL = 1e-12  # relative (Frobenius) error allowed against the float64 spec


def _rel(actual, ref) -> float:
    a = np.asarray(actual, np.float64)
    r = np.asarray(ref, np.float64)
    assert a.shape == r.shape
    if r.size == 0:
        return 0.0
    assert np.all(np.isfinite(a))
    denom = np.linalg.norm(r)
    return float(np.linalg.norm(a - r) / (denom if denom > 0 else 1.0))


def _flax64(name, seed=0):
    d = CASES[name].make(seed)
    k, a, b = S.to_flax_layout(d.W, d.A, d.B)
    arrs = [None if v is None else jnp.asarray(v, F64) for v in (d.x, k, a, b, d.m, d.bias)]
    return d, arrs


NAMES = ["basic", "odd_shapes", "rank_one", "zero_base_row", "batched_3d", "rslora", "no_bias"]


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_factored_norm_is_float64(x64, chunk_size):
    d, (_, k, a, b, _, _) = _flax64("odd_shapes")
    n = factored_norm(k, a, b, d.scaling, impl="xla", chunk_size=chunk_size)
    assert n.dtype == F64
    assert _rel(n, S.dense_norm(d.W, d.A, d.B, d.scaling)) <= TOL
    base_sq = jnp.asarray(S.base_sq_norm(d.W), F64)
    n2 = factored_norm(k, a, b, d.scaling, impl="xla", base_sq=base_sq)
    assert n2.dtype == F64 and _rel(n2, S.dense_norm(d.W, d.A, d.B, d.scaling)) <= TOL


def test_float32_inputs_stay_float32_under_x64(x64):
    """x64 alone changes nothing: f32 inputs still compute (and return) in f32."""
    d, (x, k, a, b, m, bias) = _flax64("basic")
    f32 = [v.astype(jnp.float32) for v in (x, k, a, b, m, bias)]
    assert factored_norm(*f32[1:4], d.scaling).dtype == jnp.float32
    y, pull = jax.vjp(
        lambda x, a, b, m: dora_dense(x, f32[1], a, b, m, d.scaling, f32[5]),
        f32[0],
        f32[2],
        f32[3],
        f32[4],
    )
    assert y.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in pull(jnp.ones_like(y)))


@pytest.mark.parametrize("exact", [False, True], ids=["detached", "exact"])
@pytest.mark.parametrize("name", NAMES)
def test_dora_dense_forward_and_every_gradient_match_the_spec(x64, name, exact):
    d, (x, k, a, b, m, bias) = _flax64(name)
    s = d.scaling
    dy = jnp.asarray(d.dy, F64)

    def f(x, k, a, b, m, bias):
        return dora_dense(x, k, a, b, m, s, bias, impl="xla", exact_norm_grad=exact)

    args = (x, k, a, b, m, bias)
    y, pull = jax.vjp(f, *args)
    grads = pull(dy)
    ref_y = S.dora_linear(d.x, d.W, d.A, d.B, d.m, s, d.bias)
    ref = S.dora_linear_vjp(d.x, d.W, d.A, d.B, d.m, s, d.dy, d.bias, exact_norm_grad=exact)
    assert y.dtype == F64 and _rel(y, ref_y) <= TOL, _rel(y, ref_y)
    dx, dk, da, db, dm, dbias = grads
    for g, primal in zip(grads, args):
        assert g is None or g.dtype == F64 == primal.dtype
    for label, g, r in (
        ("dx", dx, ref.dx),
        ("da", da, ref.dA.T),
        ("db", db, ref.dB.T),
        ("dm", dm, ref.dm),
        ("dbias", dbias, ref.dbias),
    ):
        if r is None:
            continue
        err = _rel(g, r)
        assert err <= TOL, f"{name}/exact={exact} {label}: rel err {err:.3g}"
    # the kernel's gradient (frozen in practice, but the VJP provides it): finite differences
    # of the spec are not needed, the chain rule through K + s·a·b gives it exactly
    if not exact:
        ref_dk = _dense_kernel_grad(d, s)
        assert _rel(dk, ref_dk) <= TOL


def _dense_kernel_grad(d, s):
    """dL/dK (Flax layout) of sum(dy · y) with the norm detached: xᵀ·(g ⊙ dy)."""
    n = S.dense_norm(d.W, d.A, d.B, s)
    g = S.magnitude_scale(d.m, n)
    x2 = d.x.reshape(-1, d.W.shape[1])
    dy2 = d.dy.reshape(-1, d.W.shape[0])
    return x2.T @ (dy2 * g)


def test_check_grads_in_x64(x64):
    """Finite differences in float64 agree with the custom VJP to float64 accuracy."""
    d, (x, k, a, b, m, bias) = _flax64("odd_shapes")

    def f(x, a, b, m, bias):
        return dora_dense(x, k, a, b, m, d.scaling, bias, impl="xla", exact_norm_grad=True)

    check_grads(f, (x, a, b, m, bias), order=1, modes=["rev"], eps=1e-6, atol=1e-7, rtol=1e-7)

    def g(x, m, bias):  # detached norm: exact in x, m and bias
        return dora_dense(x, k, a, b, m, d.scaling, bias, impl="xla")

    check_grads(g, (x, m, bias), order=1, modes=["rev"], eps=1e-6, atol=1e-7, rtol=1e-7)


def test_dropout_path_is_float64(x64):
    d, (x, k, a, b, m, bias) = _flax64("basic")
    s, rate = d.scaling, 0.3
    key = jax.random.key(0)

    def f(x, a, b, m, bias):
        return dora_dense(
            x,
            k,
            a,
            b,
            m,
            s,
            bias,
            impl="xla",
            dropout_rate=rate,
            dropout_rng=key,
            deterministic=False,
        )

    y, pull = jax.vjp(f, x, a, b, m, bias)
    dx, da, db, dm, dbias = pull(jnp.asarray(d.dy, F64))
    keep = np.asarray(jax.random.bernoulli(key, 1.0 - rate, x.shape))
    xd = np.where(keep, d.x / (1.0 - rate), 0.0)
    ref_y = S.dora_linear(d.x, d.W, d.A, d.B, d.m, s, d.bias, x_dropped=xd)
    ref = S.dora_linear_vjp(d.x, d.W, d.A, d.B, d.m, s, d.dy, d.bias, x_dropped=xd)
    ref_dx = ref.dx + np.where(keep, ref.dx_dropped / (1.0 - rate), 0.0)
    assert y.dtype == F64 and _rel(y, ref_y) <= TOL
    for g, r in ((dx, ref_dx), (da, ref.dA.T), (db, ref.dB.T), (dm, ref.dm), (dbias, ref.dbias)):
        assert g.dtype == F64 and _rel(g, r) <= TOL


def test_dora_dense_layer_is_float64(x64):
    d, (x, k, a, b, m, bias) = _flax64("magnitude_perturbed")
    lin = nnx.Linear(*k.shape, param_dtype=F64, rngs=nnx.Rngs(0))
    r = a.shape[1]
    layer = DoraDense.from_linear(lin, r=r, lora_alpha=d.scaling * r, rngs=nnx.Rngs(1))
    assert layer.scaling == pytest.approx(d.scaling, rel=1e-15)
    for name in ("lora_a", "lora_b", "magnitude"):  # PEFT's rule: the kernel's dtype
        assert getattr(layer, name).get_value().dtype == F64
    fresh_norm = np.linalg.norm(np.asarray(lin.kernel.get_value()), axis=0)  # b = 0: m = ||K||
    assert _rel(layer.magnitude.get_value(), fresh_norm) <= TOL
    for name, v in (("kernel", k), ("bias", bias), ("lora_a", a), ("lora_b", b), ("magnitude", m)):
        getattr(layer, name).set_value(v)
    y = layer(x)
    assert y.dtype == F64
    assert _rel(y, S.dora_linear(d.x, d.W, d.A, d.B, d.m, d.scaling, d.bias)) <= TOL
    dy = jnp.asarray(d.dy, F64)
    grads = nnx.grad(lambda mod: jnp.sum(mod(x) * dy), argnums=nnx.DiffState(0, DoraParam))(layer)
    ref = S.dora_linear_vjp(d.x, d.W, d.A, d.B, d.m, d.scaling, d.dy, d.bias)
    for name, r in (("lora_a", ref.dA.T), ("lora_b", ref.dB.T), ("magnitude", ref.dm)):
        g = getattr(grads, name).get_value()
        assert g.dtype == F64 and _rel(g, r) <= TOL, name
    n = layer.norm()
    assert n.dtype == F64 and _rel(n, S.dense_norm(d.W, d.A, d.B, d.scaling)) <= TOL


def test_merge_and_unmerge_are_float64(x64):
    d, (_, k, a, b, m, _) = _flax64("magnitude_perturbed")
    merged = merge_weight(k, a, b, m, d.scaling)
    assert merged.dtype == F64
    assert _rel(merged, S.merge(d.W, d.A, d.B, d.m, d.scaling).T) <= TOL
    n = factored_norm(k, a, b, d.scaling)
    back = unmerge_weight(merged, a, b, m, d.scaling, n)
    assert back.dtype == F64 and _rel(back, k) <= TOL
