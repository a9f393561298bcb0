"""DoraDense (nnx), its linen twin, inject, merge and the explicit norm caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dora_jax
import shared_spec as S
from dora_jax import DoraDense, DoraParam, inject
from dora_jax.baselines import naive_dora_dense
from dora_jax.linen import DoraDense as LinenDoraDense
from dora_jax.linen import merge_params
from shared_spec.tolerances import assert_close

from .spec_check import f64


def _x(shape=(6, 16), seed=1):
    return jax.random.normal(jax.random.key(seed), shape)


def test_fresh_adapter_reproduces_linear_and_keeps_names():
    lin = nnx.Linear(16, 12, rngs=nnx.Rngs(0))
    dora = DoraDense(16, 12, rank=4, alpha=8, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(dora.kernel.get_value(), lin.kernel.get_value())
    x = _x()
    np.testing.assert_allclose(dora(x), lin(x), rtol=1e-6, atol=1e-6)
    assert dora.kernel.get_value().shape == (16, 12) and dora.bias.get_value().shape == (12,)
    assert isinstance(dora.lora_a, nnx.LoRAParam) and isinstance(dora.magnitude, DoraParam)
    bound = 1 / np.sqrt(16)  # PEFT's kaiming_uniform(a=sqrt(5)) bound
    a = np.asarray(dora.lora_a.get_value())
    assert a.shape == (16, 4) and np.all(np.abs(a) <= bound) and np.abs(a).max() > bound / 2
    np.testing.assert_array_equal(dora.lora_b.get_value(), 0.0)

    wrapped = DoraDense.from_linear(lin, rank=4, alpha=8, rngs=nnx.Rngs(1))
    assert wrapped.kernel is lin.kernel  # the same Variable, not a copy
    np.testing.assert_allclose(wrapped(_x((2, 3, 16))), lin(_x((2, 3, 16))), rtol=1e-6, atol=1e-6)


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 24, rngs=rngs)
        self.down = nnx.Linear(24, 8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.gelu(self.down(nnx.gelu(self.up(x)))))


def _snapshot(model, filt):
    """Copies (not views) of the model's arrays selected by ``filt``, skipping RNG/optimizer."""
    state = nnx.state(model, nnx.All(nnx.Param, filt))
    return [np.array(v) for v in jax.tree.leaves(state)]


def test_training_changes_only_the_adapter_and_lowers_loss():
    model = _Mlp(nnx.Rngs(0))
    replaced = inject(model, target=r"^(up|down)$", rank=4, alpha=8, rngs=nnx.Rngs(1), impl="xla")
    assert replaced == ["down", "up"] or replaced == ["up", "down"]
    assert isinstance(model.up, DoraDense) and isinstance(model.head, nnx.Linear)
    frozen_before = _snapshot(model, nnx.Not(nnx.LoRAParam))
    adapter_before = _snapshot(model, nnx.LoRAParam)
    assert len(frozen_before) == 6 and len(adapter_before) == 6
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    x, t = _x((32, 16)), jnp.sin(_x((32, 1), seed=2))

    @nnx.jit
    def step(model, opt):
        def loss_fn(model):
            return jnp.mean((model(x) - t) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(8)]
    assert losses[-1] < losses[0]
    for u, v in zip(frozen_before, _snapshot(model, nnx.Not(nnx.LoRAParam))):
        np.testing.assert_array_equal(u, v)
    moved = [
        not np.array_equal(u, v) for u, v in zip(adapter_before, _snapshot(model, nnx.LoRAParam))
    ]
    assert all(moved)


ALPHA = 6.8  # s = alpha / rank = 1.7: not 2, where the norm's 2s and s² coincide


def _trained_layer(**kw):
    dora = DoraDense(16, 12, rank=4, alpha=ALPHA, rngs=nnx.Rngs(0), **kw)
    key_b, key_m = jax.random.split(jax.random.key(3))
    dora.lora_b.set_value(0.3 * jax.random.normal(key_b, (4, 12)))
    dora.magnitude.set_value(
        dora.magnitude.get_value() * (1 + 0.1 * jax.random.normal(key_m, (12,)))
    )
    return dora


def test_merge_and_frozen_norm_match_the_unmerged_layer():
    dora = _trained_layer()
    x = _x()
    y = dora(x)
    merged = dora.to_linear()
    assert isinstance(merged, nnx.Linear)
    np.testing.assert_allclose(merged(x), y, rtol=1e-5, atol=1e-5)
    dora.freeze_norm()
    dora.cache_base_sq()
    assert isinstance(dora.frozen_norm, dora_jax.DoraCache)
    np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(dora, x), y, rtol=1e-5, atol=1e-6)
    dora.lora_b.set_value(dora.lora_b.get_value() * 2)  # stale until cleared, by design
    stale = dora(x)
    dora.clear_cache()
    assert not np.allclose(stale, dora(x))


def test_jit_vmap_remat_on_module():
    dora = _trained_layer()
    x = _x((3, 5, 16))
    y = dora(x)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(dora, x), y, rtol=1e-5, atol=1e-6)
    yv = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(dora, x)
    np.testing.assert_allclose(yv, y, rtol=1e-5, atol=1e-6)
    g = nnx.grad(nnx.remat(lambda m: jnp.sum(m(x) ** 2)), argnums=nnx.DiffState(0, nnx.LoRAParam))(
        dora
    )
    g0 = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam))(dora)
    for u, v in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def test_bf16_compute_dtype_matches_spec():
    """dtype=bf16 with f32 adapters: output and adapter gradients against the float64 spec
    (on the values the layer computes with: x and kernel in bf16, adapters and bias as stored)
    by the shared tolerance rule; baseline: naive dense DoRA in bf16."""
    bf16 = jnp.bfloat16
    dora = _trained_layer(dtype=bf16)
    assert dora.lora_a.get_value().dtype == jnp.float32
    x = _x().astype(bf16)
    dy = jax.random.normal(jax.random.key(4), (6, 12)).astype(bf16)
    kernel = dora.kernel.get_value().astype(bf16)
    bias = dora.bias.get_value()
    adapters = [getattr(dora, n).get_value() for n in ("lora_a", "lora_b", "magnitude")]

    y = dora(x)
    assert y.dtype == bf16
    grads = nnx.grad(
        lambda mod: jnp.sum(mod(x).astype(jnp.float32) * dy.astype(jnp.float32)),
        argnums=nnx.DiffState(0, nnx.LoRAParam),
    )(dora)
    ours = [y] + [grads[n].get_value() for n in ("lora_a", "lora_b", "magnitude")]

    def naive(a, b, m):
        return naive_dora_dense(x, kernel, a, b, m, dora.scaling, bias)

    y0, pull = jax.vjp(naive, *adapters)
    baseline = [y0, *pull(dy)]

    W, A, B = S.from_flax_layout(f64(kernel), *(f64(v) for v in adapters[:2]))
    spec_in = (f64(x), W, A, B, f64(adapters[2]), dora.scaling)
    ref = S.dora_linear_vjp(*spec_in, f64(dy), f64(bias))
    refs = [S.dora_linear(*spec_in, f64(bias)), ref.dA.T, ref.dB.T, ref.dm]  # Flax layout
    for name, got, want, base in zip(("y", "da", "db", "dm"), ours, refs, baseline):
        assert got.dtype == (bf16 if name == "y" else jnp.float32), name
        assert_close(f64(got), want, f64(base), machine_eps=2.0**-7, name=f"bf16 {name}")


def test_linen_twin_gives_identical_numbers():
    dora = _trained_layer()
    params = {
        name: getattr(dora, name).get_value()
        for name in ("kernel", "bias", "lora_a", "lora_b", "magnitude")
    }
    twin = LinenDoraDense(features=12, rank=4, alpha=ALPHA)
    x = _x((2, 6, 16))
    fresh = twin.init(jax.random.key(0), x)["params"]
    assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, params)
    np.testing.assert_array_equal(twin.apply({"params": params}, x), dora(x))
    grad_nnx = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam))(dora)
    grad_linen = jax.grad(lambda p: jnp.sum(twin.apply({"params": p}, x) ** 2))(params)
    for name in ("lora_a", "lora_b", "magnitude"):
        np.testing.assert_array_equal(grad_linen[name], grad_nnx[name].get_value())
    dense = merge_params(params, scaling=twin.scaling)
    np.testing.assert_allclose(x @ dense["kernel"] + dense["bias"], dora(x), rtol=1e-5, atol=1e-5)


def test_sharding_metadata_is_preserved():
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((1, 1), ("embed", "mlp"), axis_types=(auto, auto))
    with jax.set_mesh(mesh):
        lin = nnx.Linear(
            16,
            12,
            rngs=nnx.Rngs(0),
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
        )
        dora = DoraDense.from_linear(lin, rank=4, alpha=8, rngs=nnx.Rngs(1))
        merged = dora.to_linear()
    assert dora.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")
    assert dora.lora_a.get_metadata()["out_sharding"] == ("embed", None)
    assert dora.lora_b.get_metadata()["out_sharding"] == (None, "mlp")
    assert dora.magnitude.get_metadata()["out_sharding"] == ("mlp",)
    assert merged.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")


def test_inject_predicate_and_errors():
    model = _Mlp(nnx.Rngs(0))
    replaced = inject(
        model, target=lambda path, lin: lin.out_features == 1, rank=1, alpha=1, rngs=nnx.Rngs(1)
    )
    assert replaced == ["head"] and isinstance(model.head, DoraDense)
    with pytest.raises(ValueError, match=r"matched no nnx\.Linear"):
        inject(_Mlp(nnx.Rngs(0)), target="nothing_like_this", rank=2, alpha=2, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="rank"):
        DoraDense(4, 4, rank=0, alpha=1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="linear"):
        DoraDense.from_linear(model.head, rank=2, alpha=2, rngs=nnx.Rngs(0))  # already DoRA


def test_inject_into_lists():
    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(3)])

    model = Stack(nnx.Rngs(0))
    x = _x((4, 8))
    before = [layer(x) for layer in model.layers]
    assert inject(model, target=r"layers/[02]$", rank=2, alpha=4, rngs=nnx.Rngs(1)) == [
        "layers/0",
        "layers/2",
    ]
    assert [type(layer).__name__ for layer in model.layers] == ["DoraDense", "Linear", "DoraDense"]
    for layer, y in zip(model.layers, before):
        np.testing.assert_allclose(layer(x), y, rtol=1e-5, atol=1e-6)
