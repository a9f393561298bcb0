"""dora_dense and factored_norm: gradients by finite differences, transforms, edge cases, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

import dora_jax
import shared_spec as S
from dora_jax import DoraDense, factored_norm, inject, linen
from dora_jax.config import OPS
from dora_jax.functional import dora_dense, resolved_impls
from dora_jax.sharding import NormSharding, layer_norm, sharded_factored_norm, sharded_norm_parts
from shared_spec.cases import CASES


def _flax(case_name, dtype=jnp.float32, seed=0):
    d = CASES[case_name].make(seed)
    k, a, b = S.to_flax_layout(d.W, d.A, d.B)
    arr = [None if v is None else jnp.asarray(v, dtype) for v in (d.x, k, a, b, d.m, d.bias)]
    return d, arr


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_factored_norm_matches_spec(chunk_size):
    d, (_, k, a, b, _, _) = _flax("odd_shapes")
    ref = S.dense_norm(d.W, d.A, d.B, d.scaling)
    n = factored_norm(k, a, b, d.scaling, impl="xla", chunk_size=chunk_size)
    assert n.dtype == jnp.float32 and n.shape == (d.W.shape[0],)
    np.testing.assert_allclose(np.asarray(n), ref, rtol=2e-6)
    base_sq = S.base_sq_norm(d.W).astype(np.float32)
    n2 = factored_norm(k, a, b, d.scaling, impl="xla", base_sq=jnp.asarray(base_sq))
    np.testing.assert_allclose(np.asarray(n2), ref, rtol=2e-6)


def test_check_grads_exact_mode():
    """Finite differences agree with the custom VJP when the norm is differentiated too."""
    _, (x, k, a, b, m, bias) = _flax("odd_shapes")

    def f(x, a, b, m, bias):
        return dora_dense(x, k, a, b, m, 2.0, bias, impl="xla", exact_norm_grad=True)

    check_grads(f, (x, a, b, m, bias), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def test_check_grads_detached_mode_x_and_m():
    """With the norm detached the VJP is exact for x, magnitude and bias (n is constant there)."""
    _, (x, k, a, b, m, bias) = _flax("basic")

    def f(x, m, bias):
        return dora_dense(x, k, a, b, m, 2.0, bias, impl="xla")

    check_grads(f, (x, m, bias), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def test_detached_gradient_differs_from_exact():
    """The option changes what it claims to: dA/dB move, dm does not."""
    _, (x, k, a, b, m, bias) = _flax("magnitude_perturbed")

    def loss(a, b, m, exact):
        return jnp.sum(dora_dense(x, k, a, b, m, 2.0, bias, impl="xla", exact_norm_grad=exact))

    g0 = jax.grad(loss, argnums=(0, 1, 2))(a, b, m, False)
    g1 = jax.grad(loss, argnums=(0, 1, 2))(a, b, m, True)
    assert not np.allclose(g0[0], g1[0]) and not np.allclose(g0[1], g1[1])
    np.testing.assert_allclose(g0[2], g1[2], rtol=1e-6)


def test_jit_vmap_remat_agree():
    _, (x, k, a, b, m, bias) = _flax("batched_3d")  # x [2, 5, 24]
    impl = "xla"

    def loss(x, a, b, m):
        return jnp.sum(jnp.sin(dora_dense(x, k, a, b, m, 2.0, bias, impl=impl)))

    eager = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, a, b, m)
    jitted = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, a, b, m)
    remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))(x, a, b, m)
    for other in (jitted, remat):
        for u, v in zip(jax.tree.leaves(eager), jax.tree.leaves(other)):
            np.testing.assert_allclose(u, v, rtol=2e-5, atol=1e-6)

    # vmap over the leading axis of x equals the 3-D call
    y3 = dora_dense(x, k, a, b, m, 2.0, bias, impl=impl)
    yv = jax.vmap(lambda xi: dora_dense(xi, k, a, b, m, 2.0, bias, impl=impl))(x)
    np.testing.assert_allclose(yv, y3, rtol=1e-5, atol=1e-6)
    # and vmap over per-example adapters (a batch of magnitudes) matches a loop
    ms = jnp.stack([m, 2 * m])
    yb = jax.vmap(lambda mi: dora_dense(x, k, a, b, mi, 2.0, bias, impl=impl))(ms)
    np.testing.assert_allclose(
        yb[1], dora_dense(x, k, a, b, 2 * m, 2.0, bias, impl=impl), rtol=1e-5
    )
    gv = jax.vmap(jax.grad(lambda xi: jnp.sum(dora_dense(xi, k, a, b, m, 2.0, bias, impl=impl))))(x)
    assert gv.shape == x.shape and bool(jnp.all(jnp.isfinite(gv)))


def test_every_part_of_the_layer_is_named_in_the_compiled_program():
    """The name scopes of ``dora_jax.vjp`` reach the optimized HLO's op names, where
    ``benchmarks/profile_jax`` reads them to put each kernel of a step under one part."""
    from dora_jax import vjp

    _, (x, k, a, b, m, bias) = _flax("batched_3d")

    def loss(x, a, b, m):
        return jnp.sum(jnp.sin(dora_dense(x, k, a, b, m, 2.0, bias, impl="xla")))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    hlo = grad.lower(x, a, b, m).compile().as_text()
    scopes = (vjp.NORM_SCOPE, vjp.COMPOSE_SCOPE, vjp.REDUCE_SCOPE, vjp.GRADS_SCOPE)
    missing = [sc for sc in scopes if f"({sc})" not in hlo and f"/{sc}/" not in hlo]
    assert not missing, f"name scopes missing from the optimized HLO: {missing}"


def test_zero_rows_and_empty_input_stay_finite():
    _, (x, k, a, b, m, bias) = _flax("zero_base_row")
    impl = "xla"
    y, pull = jax.vjp(
        lambda x, a, b, m: dora_dense(x, k, a, b, m, 2.0, bias, impl=impl), x, a, b, m
    )
    assert bool(jnp.all(jnp.isfinite(y)))
    np.testing.assert_array_equal(y[:, 0], jnp.broadcast_to(bias[0], y[:, 0].shape))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in pull(jnp.ones_like(y)))

    y0 = dora_dense(x[:0], k, a, b, m, 2.0, bias, impl=impl)
    assert y0.shape == (0, k.shape[1])
    g0 = jax.grad(lambda a: jnp.sum(dora_dense(x[:0], k, a, b, m, 2.0, bias, impl=impl)))(a)
    np.testing.assert_array_equal(g0, 0.0)


def test_bf16_boundary_and_f32_params():
    """bf16 activations with f32 adapters: output bf16, adapter gradients f32."""
    _, (x, k, a, b, m, bias) = _flax("basic")
    xb, kb = x.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    y, pull = jax.vjp(lambda x, a, b, m: dora_dense(x, kb, a, b, m, 2.0, bias), xb, a, b, m)
    assert y.dtype == jnp.bfloat16
    dx, da, db, dm = pull(jnp.ones_like(y))
    assert dx.dtype == jnp.bfloat16 and {da.dtype, db.dtype, dm.dtype} == {jnp.dtype(jnp.float32)}


def test_frozen_norm_is_a_constant():
    _, (x, k, a, b, m, bias) = _flax("basic")
    n = factored_norm(k, a, b, 2.0)
    np.testing.assert_allclose(
        dora_dense(x, k, a, b, m, 2.0, bias, norm=n),
        dora_dense(x, k, a, b, m, 2.0, bias),
        rtol=1e-6,
    )
    # The given norm is really used: doubling it halves g, hence y − bias.
    np.testing.assert_allclose(
        dora_dense(x, k, a, b, m, 2.0, bias, norm=2 * n) - bias,
        (dora_dense(x, k, a, b, m, 2.0, bias) - bias) / 2,
        rtol=1e-5,
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="norm"):
        dora_dense(x, k, a, b, m, 2.0, bias, norm=n, exact_norm_grad=True)


def test_frozen_norm_refuses_adapter_gradients():
    _, (x, k, a, b, m, bias) = _flax("basic")
    n = factored_norm(k, a, b, 2.0)

    def loss(a, b, m):
        return jnp.sum(dora_dense(x, k, a, b, m, 2.0, bias, norm=n) ** 2)

    with pytest.raises(ValueError, match="stale"):
        jax.grad(loss, argnums=(0, 1))(a, b, m)
    # The magnitude alone (adapters frozen) may still be trained against a frozen norm.
    dm = jax.grad(loss, argnums=2)(a, b, m)
    assert np.all(np.isfinite(dm))


def test_auto_resolves_to_xla_on_cpu():
    assert set(resolved_impls((16, 64), (64, 48), 8).values()) == {"xla"}
    assert set(resolved_impls((16, 64), (64, 48), 8, impl="xla").values()) == {"xla"}


@pytest.mark.parametrize("hopper", [False, True], ids=["other_gpu", "hopper"])
def test_auto_table_on_gpu_follows_the_measurements(monkeypatch, hopper):
    from dora_jax import config

    monkeypatch.setattr(config, "_one_hopper", lambda: hopper)

    def auto(tokens):
        shape = (tokens, 4096, 4096, 384)
        return {
            op: config.resolve_impl("auto", op, platform="gpu", shape=shape, dtype=jnp.bfloat16)
            for op in OPS
        }

    # XLA was measured fastest on the H200 for the compose and the norm (runs 32, 108); the
    # backward's cotangent passes won the model step at every shape measured (the SwiGLU pair:
    # run 115; one layer's scale-and-reduce: runs 122-123), with one Hopper GPU alone.
    kernels = {"scale_reduce", "swiglu"}
    assert {op for op, rule in config.AUTO_MOSAIC.items() if rule is not None} == kernels
    for tokens in (512, 4096):
        want = {op: "mosaic" if hopper and op in kernels else "xla" for op in OPS}
        assert auto(tokens) == want
    assert auto(100)["swiglu"] == auto(100)["scale_reduce"] == "xla"  # no tile of 64 rows


def test_auto_picks_no_kernel_with_several_gpus(monkeypatch):
    """A Mosaic custom call is not partitioned by XLA's SPMD partitioner, so a process that
    sees several GPUs keeps the XLA path under "auto" (``config._one_hopper``)."""
    from dora_jax import config

    class Gpu:
        compute_capability = "9.0"

    monkeypatch.setattr(config.jax, "devices", lambda backend=None: [Gpu()])
    assert config._one_hopper()
    monkeypatch.setattr(config.jax, "devices", lambda backend=None: [Gpu(), Gpu()])
    assert not config._one_hopper()
    Gpu.compute_capability = "8.0"
    monkeypatch.setattr(config.jax, "devices", lambda backend=None: [Gpu()])
    assert not config._one_hopper()


IMPL_ERROR = r"impl must be one of \('auto', 'xla', 'mosaic'\); got 'pallas' \(the Triton-backend"


def _rng_counts(module) -> list[int]:
    """How many keys each rng stream of ``module`` has drawn (copies, not references)."""
    return [int(v) for v in jax.tree.leaves(nnx.state(module, nnx.RngCount))]


def test_removed_pallas_impl_is_refused_everywhere():
    """impl="pallas" (the removed Triton-backend kernels) is a ValueError that names the
    argument, the valid values and the replacement, from every entry point, and the failed
    call changes nothing: no layer is installed, no key is drawn."""
    _, (x, k, a, b, m, bias) = _flax("basic")
    net = nnx.Dict(up=nnx.Linear(4, 6, rngs=nnx.Rngs(0)))
    rngs = nnx.Rngs(1)
    layer = DoraDense(4, 6, r=2, lora_alpha=4, lora_dropout=0.5, rngs=nnx.Rngs(2))
    calls = [
        lambda: dora_dense(x, k, a, b, m, 2.0, bias, impl="pallas"),
        lambda: factored_norm(k, a, b, 2.0, impl="pallas"),
        lambda: resolved_impls(x.shape, k.shape, a.shape[1], impl="pallas"),
        lambda: sharded_factored_norm(k, a, b, 2.0, kernel_spec=(None, None), impl="pallas"),
        lambda: sharded_norm_parts(
            k, a, b, None, sharding=NormSharding((None, None)), scaling=2.0, impl="pallas"
        ),
        lambda: layer_norm(layer, impl="pallas"),
        lambda: linen.DoraDense(5, r=2, lora_alpha=4, impl="pallas"),
        lambda: DoraDense(4, 6, r=2, lora_alpha=4, rngs=rngs, impl="pallas"),
        lambda: DoraDense.from_linear(net["up"], r=2, lora_alpha=4, rngs=rngs, impl="pallas"),
        lambda: inject(net, target_modules=["up"], r=2, lora_alpha=4, rngs=rngs, impl="pallas"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=IMPL_ERROR) as err:
            call()
        assert str(err.value).endswith('use "xla" or "mosaic")')
    assert type(net["up"]) is nnx.Linear and _rng_counts(rngs) == [0]

    layer.impl = "pallas"  # set after construction: the call refuses it before drawing a key
    counts = _rng_counts(layer)
    with pytest.raises(ValueError, match=IMPL_ERROR):
        layer(jnp.ones((3, 4)))
    assert _rng_counts(layer) == counts
    assert not hasattr(dora_jax, "BlockConfig") and not hasattr(dora_jax, "AUTO_PALLAS")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda v: {**v, "kernel": v["kernel"].T}, "lora_a"),
        (lambda v: {**v, "lora_a": v["lora_a"][:, :3]}, "lora_b"),
        (lambda v: {**v, "lora_b": v["lora_b"][:, :5]}, "lora_b"),
        (lambda v: {**v, "x": v["x"][:, :7]}, "x must have shape"),
        (lambda v: {**v, "magnitude": v["magnitude"][:3]}, "magnitude"),
        (lambda v: {**v, "bias": v["bias"][None]}, "bias"),
        (lambda v: {**v, "x": v["x"].astype(jnp.int32)}, "x must have a floating dtype"),
        (lambda v: {**v, "lora_a": v["lora_a"].astype(jnp.int32)}, "lora_a must have a floating"),
        (lambda v: {**v, "kernel": v["kernel"][None]}, "kernel must be 2-D"),
        (lambda v: {**v, "scaling": float("nan")}, "scaling"),
        (lambda v: {**v, "impl": "cuda"}, "impl"),
    ],
)
def test_bad_arguments_raise_value_error(change, match):
    _, (x, k, a, b, m, bias) = _flax("basic")
    args = dict(x=x, kernel=k, lora_a=a, lora_b=b, magnitude=m, scaling=2.0, bias=bias, impl="xla")
    args = change(args)
    impl = args.pop("impl")
    with pytest.raises(ValueError, match=match):
        dora_dense(**args, impl=impl)
