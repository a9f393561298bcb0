"""Adapter dropout (PEFT's form, docs/design.md §1) in dora_dense, DoraDense and the linen twin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.test_util import check_grads

import shared_spec as S
from dora_jax import DoraDense, inject
from dora_jax.functional import dora_dense, dropout_mask
from dora_jax.linen import DoraDense as LinenDoraDense
from shared_spec.cases import CASES
from shared_spec.compose import EPS
from shared_spec.tolerances import assert_close

from .spec_check import _cast, _value_and_vjp, f64

RATE = 0.3
KEY = jax.random.key(7)


def _dropped(x, mask, rate=RATE):
    """x_d exactly as dora_dense forms it from the keep mask (in x's dtype)."""
    return jax.lax.select(mask, x / (1.0 - rate), jnp.zeros_like(x))


def _naive_dropout_dora(x, k, a, b, m, s, bias, mask, exact=False):
    """The dropout form as plain jnp in x's dtype (g and g − 1 in that dtype): the baseline."""
    dt = x.dtype
    x_d = _dropped(x, mask)
    w = k + s * (a.astype(dt) @ b.astype(dt))
    n = jnp.sqrt(jnp.sum(jnp.square(w.astype(jnp.float32)), axis=0))
    n = n if exact else jax.lax.stop_gradient(n)
    g = (m.astype(jnp.float32) / jnp.maximum(n, EPS)).astype(dt)
    y = x @ k + (g - 1) * (x_d @ k) + g * s * ((x_d @ a.astype(dt)) @ b.astype(dt))
    return y + bias.astype(dt)


def _ours(k, s, **kw):
    def f(x, a, b, m, bias):
        return dora_dense(
            x, k, a, b, m, s, bias, dropout_rate=RATE, dropout_rng=KEY, deterministic=False, **kw
        )

    return f


@pytest.mark.parametrize("exact", [False, True], ids=["detached", "exact"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["basic", "batched_3d", "magnitude_perturbed", "near_unity_g"])
def test_dropout_matches_spec_with_the_same_mask(name, dtype, exact):
    """Forward and every gradient vs shared_spec's dropout form, x_d built from the same mask
    (the Mosaic compose's fallback to this XLA form: test_mosaic.py)."""
    check_dropout(CASES[name], dtype, exact, impl="xla")


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_dropout_with_the_mosaic_scale_reduce_matches_spec(dtype):
    """impl="mosaic" on a shape the kernels tile: the compose falls back to XLA's dropout form,
    and the backward's scale-and-reduce runs the Mosaic kernel (interpreted here)."""
    from dora_jax.functional import resolved_impls

    from .compose_check import MOSAIC_CASES

    case = MOSAIC_CASES[0]
    shape = (*case.lead, case.d_in)
    impls = resolved_impls(shape, (case.d_in, case.d_out), case.r, impl="mosaic", dtype=dtype)
    assert impls["scale_reduce"] == "mosaic"
    check_dropout(case, dtype, False, impl="mosaic")


def check_dropout(case, dtype, exact, *, impl):
    d = case.make(0)
    name = case.name
    kernel, lora_a, lora_b = S.to_flax_layout(d.W, d.A, d.B)
    x, k, a, b, m, bias = (_cast(v, dtype) for v in (d.x, kernel, lora_a, lora_b, d.m, d.bias))
    dy, s = _cast(d.dy, dtype), d.scaling
    mask = dropout_mask(KEY, RATE, x.shape)

    W, A, B = S.from_flax_layout(f64(k), f64(a), f64(b))
    x_d = f64(_dropped(x, mask))
    args64 = (f64(x), W, A, B, f64(m), s)
    ref_y = S.dora_linear(*args64, f64(bias), x_dropped=x_d)
    ref = S.dora_linear_vjp(*args64, f64(dy), f64(bias), x_dropped=x_d, exact_norm_grad=exact)
    # dx_d reaches x through x_d = mask·x/(1 − rate)
    ref_dx = ref.dx + np.asarray(mask) / (1.0 - RATE) * ref.dx_dropped

    ours = _ours(k, s, impl=impl, exact_norm_grad=exact)
    y, grads = _value_and_vjp(ours, (x, a, b, m, bias), dy)

    def naive(x, a, b, m, bias):
        return _naive_dropout_dora(x, k, a, b, m, s, bias, mask, exact)

    y0, grads0 = _value_and_vjp(naive, (x, a, b, m, bias), dy)
    assert y.dtype == x.dtype and y.shape == ref_y.shape
    eps = float(jnp.finfo(dtype).eps)
    floor = eps if dtype == jnp.float32 else None  # as spec_check: f32 floor of one ulp
    tag = f"{name}/{jnp.dtype(dtype).name}/exact={exact}"
    assert_close(f64(y), ref_y, f64(y0), machine_eps=eps, floor=floor, name=f"{tag} y")
    refs = (ref_dx, ref.dA.T, ref.dB.T, ref.dm, ref.dbias)
    for q, g, g0, r in zip(("dx", "dA", "dB", "dm", "dbias"), grads, grads0, refs):
        assert g.dtype == jnp.dtype(dtype)
        assert_close(f64(g), r, f64(g0), machine_eps=eps, floor=floor, name=f"{tag} {q}")


def test_check_grads_on_the_dropout_path():
    impl = "xla"
    d = CASES["odd_shapes"].make(0)
    kernel, lora_a, lora_b = S.to_flax_layout(d.W, d.A, d.B)
    x, k, a, b, m, bias = (
        _cast(v, jnp.float32) for v in (d.x, kernel, lora_a, lora_b, d.m, d.bias)
    )
    tol = dict(order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)
    check_grads(_ours(k, 2.0, impl=impl, exact_norm_grad=True), (x, a, b, m, bias), **tol)
    detached = _ours(k, 2.0, impl=impl)
    check_grads(lambda x, m, bias: detached(x, a, b, m, bias), (x, m, bias), **tol)
    # the kernel's gradient (base products on x and on x_d), through the exact-norm path
    exact_k = lambda k: dora_dense(  # noqa: E731
        x, k, a, b, m, 2.0, bias, dropout_rate=RATE, dropout_rng=KEY, deterministic=False,
        impl=impl, exact_norm_grad=True,
    )  # fmt: skip
    check_grads(exact_k, (k,), **tol)


def test_rate_zero_and_deterministic_run_the_plain_program():
    d = CASES["magnitude_perturbed"].make(0)
    kernel, lora_a, lora_b = S.to_flax_layout(d.W, d.A, d.B)
    x, k, a, b, m, bias = (
        _cast(v, jnp.float32) for v in (d.x, kernel, lora_a, lora_b, d.m, d.bias)
    )

    def run(**kw):
        f = lambda x, a, b, m: dora_dense(x, k, a, b, m, 2.0, bias, **kw)  # noqa: E731
        y, pull = jax.vjp(f, x, a, b, m)
        return [np.asarray(v) for v in (y, *pull(jnp.ones_like(y)))]

    plain = run()
    for kw in (
        dict(dropout_rate=0.0, dropout_rng=KEY, deterministic=False),
        dict(dropout_rate=0.0, deterministic=False),  # no key needed at rate 0
        dict(dropout_rate=0.5, dropout_rng=KEY),  # deterministic=True by default
        dict(dropout_rate=0.5, deterministic=True),
    ):
        for got, want in zip(run(**kw), plain):
            np.testing.assert_array_equal(got, want)
    active = run(dropout_rate=0.5, dropout_rng=KEY, deterministic=False)
    assert not np.allclose(active[0], plain[0])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(dropout_rate=-0.1, dropout_rng=KEY, deterministic=False), "dropout_rate"),
        (dict(dropout_rate=1.0, dropout_rng=KEY, deterministic=False), "dropout_rate"),
        (dict(dropout_rate=float("nan"), dropout_rng=KEY, deterministic=False), "dropout_rate"),
        (dict(dropout_rate="x"), "dropout_rate"),
        (dict(dropout_rate=0.2, deterministic=False), "dropout_rng"),
    ],
)
def test_bad_dropout_arguments_raise_value_error(kw, match):
    d = CASES["basic"].make(0)
    kernel, lora_a, lora_b = S.to_flax_layout(d.W, d.A, d.B)
    x, k, a, b, m = (_cast(v, jnp.float32) for v in (d.x, kernel, lora_a, lora_b, d.m))
    with pytest.raises(ValueError, match=match):
        dora_dense(x, k, a, b, m, 2.0, **kw)
    with pytest.raises(ValueError, match="dropout_rate must be a concrete"):
        jax.jit(lambda r: dora_dense(x, k, a, b, m, 2.0, dropout_rate=r))(0.1)
    with pytest.raises(ValueError, match="lora_dropout"):
        DoraDense(8, 4, rank=2, alpha=4, lora_dropout=1.5, rngs=nnx.Rngs(0))


def _layer(**kw):
    layer = DoraDense(16, 12, rank=4, alpha=8, rngs=nnx.Rngs(0), **kw)
    layer.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(3), (4, 12)))
    return layer


def test_module_dropout_follows_nnx_conventions():
    x = jax.random.normal(jax.random.key(1), (6, 16))
    layer, plain = _layer(lora_dropout=0.25), _layer()
    # a key given to the call: the functional result with that key
    params = [getattr(layer, n).get_value() for n in ("kernel", "lora_a", "lora_b", "magnitude")]
    want = dora_dense(x, *params, layer.scaling, layer.bias.get_value(), dropout_rate=0.25,
                      dropout_rng=KEY, deterministic=False)  # fmt: skip
    np.testing.assert_array_equal(layer(x, rngs=KEY), want)
    # training by default (as nnx.Dropout): fresh masks from the forked "dropout" stream
    y1, y2 = layer(x), layer(x)
    assert not np.allclose(y1, y2) and not np.allclose(y1, plain(x))
    layer.eval()
    np.testing.assert_array_equal(layer(x), plain(x))
    np.testing.assert_array_equal(layer(x, deterministic=False, rngs=KEY), want)
    layer.train()
    assert not np.allclose(layer(x), plain(x))
    np.testing.assert_array_equal(nnx.view(layer, deterministic=True)(x), plain(x))
    np.testing.assert_array_equal(layer(x, deterministic=True), plain(x))


def test_linen_dropout_uses_the_dropout_collection():
    x = jax.random.normal(jax.random.key(1), (6, 16))
    twin = LinenDoraDense(features=12, rank=4, alpha=8, lora_dropout=0.25)
    variables = twin.init(jax.random.key(0), x, deterministic=True)
    params = dict(variables["params"])
    params["lora_b"] = 0.3 * jax.random.normal(jax.random.key(3), (4, 12))
    v = {"params": params}
    plain = LinenDoraDense(features=12, rank=4, alpha=8).apply(v, x)
    np.testing.assert_array_equal(twin.apply(v, x, deterministic=True), plain)
    y1 = twin.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    y2 = twin.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(y1, plain) and not np.allclose(y1, y2)
    with pytest.raises(Exception, match="dropout"):  # flax: no 'dropout' rng given
        twin.apply(v, x, deterministic=False)


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 24, rngs=rngs)
        self.down = nnx.Linear(24, 8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.gelu(self.down(nnx.gelu(self.up(x)))))


def test_training_with_dropout_changes_only_the_adapter_and_lowers_loss():
    model = _Mlp(nnx.Rngs(0))
    inject(model, target=r"^(up|down)$", rank=4, alpha=8, rngs=nnx.Rngs(1), lora_dropout=0.1)
    assert model.up.lora_dropout == 0.1 and not model.up.deterministic

    def snapshot(filt):
        return [np.array(v) for v in jax.tree.leaves(nnx.state(model, nnx.All(nnx.Param, filt)))]

    frozen_before, adapter_before = snapshot(nnx.Not(nnx.LoRAParam)), snapshot(nnx.LoRAParam)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    x = jax.random.normal(jax.random.key(1), (32, 16))
    t = jnp.sin(jax.random.normal(jax.random.key(2), (32, 1)))

    @nnx.jit
    def step(model, opt):
        def loss_fn(model):
            return jnp.mean((model(x) - t) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(12)]
    assert losses[-1] < losses[0]
    for u, v in zip(frozen_before, snapshot(nnx.Not(nnx.LoRAParam))):
        np.testing.assert_array_equal(u, v)
    assert all(not np.array_equal(u, v) for u, v in zip(adapter_before, snapshot(nnx.LoRAParam)))
    model.eval()
    y = model(x)
    np.testing.assert_array_equal(model(x), y)  # eval: deterministic
