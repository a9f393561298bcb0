"""One vocabulary, PEFT's (and dora_torch's): r, lora_alpha, use_rslora, lora_dropout; the old
rank/alpha keywords as deprecated aliases; merge()/unmerge() in place as dora_torch.Linear;
merge_weight/unmerge_weight as the functional merge."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dora_jax
import shared_spec as S
from dora_jax import DoraDense, merge_weight, unmerge_weight
from dora_jax.linen import DoraDense as LinenDoraDense
from dora_jax.linen import merge_params, unmerge_params


def _x(shape=(6, 16), seed=1):
    return jax.random.normal(jax.random.key(seed), shape)


# ------------------------------------------------------------------------------------------
# names
# ------------------------------------------------------------------------------------------


def test_nnx_constructor_takes_peft_names():
    layer = DoraDense(
        16, 12, r=4, lora_alpha=8, use_rslora=True, lora_dropout=0.1, rngs=nnx.Rngs(0)
    )
    assert (layer.r, layer.lora_alpha, layer.use_rslora, layer.lora_dropout) == (4, 8.0, True, 0.1)
    assert layer.scaling == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(r)
    assert layer.lora_a.get_value().shape == (16, 4)


def test_from_linear_and_linen_take_peft_names():
    lin = nnx.Linear(16, 12, rngs=nnx.Rngs(0))
    layer = DoraDense.from_linear(lin, r=2, lora_alpha=6, lora_dropout=0.2, rngs=nnx.Rngs(1))
    assert (layer.r, layer.lora_alpha, layer.lora_dropout, layer.scaling) == (2, 6.0, 0.2, 3.0)
    twin = LinenDoraDense(12, r=2, lora_alpha=6, use_rslora=False, lora_dropout=0.0)
    assert twin.scaling == 3.0
    params = twin.init(jax.random.key(0), _x())["params"]
    assert params["lora_a"].shape == (16, 2) and params["lora_b"].shape == (2, 12)


# Every constructor that takes the adapter's hyperparameters, called with keyword dict kw.
MAKERS = [
    lambda kw: DoraDense(16, 12, rngs=nnx.Rngs(0), **kw),
    lambda kw: DoraDense.from_linear(nnx.Linear(16, 12, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1), **kw),
    lambda kw: LinenDoraDense(12, **kw),
]
MAKER_IDS = ["nnx", "from_linear", "linen"]


def _deprecations(record):
    return [w for w in record if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_old_names_warn_and_still_work(make):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        old = make({"rank": 4, "alpha": 8})
    messages = [str(w.message) for w in _deprecations(record)]
    assert any("'rank'" in m and "'r'" in m for m in messages), messages
    assert any("'alpha'" in m and "'lora_alpha'" in m for m in messages), messages
    # attributed to this file (the caller), not to dora_jax or flax internals
    assert all(w.filename == __file__ for w in _deprecations(record)), [
        w.filename for w in _deprecations(record)
    ]
    new = make({"r": 4, "lora_alpha": 8})
    assert old.scaling == new.scaling == 2.0
    assert old.r == new.r == 4 and old.lora_alpha == new.lora_alpha == 8


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_both_names_or_neither_is_a_type_error(make):
    with pytest.raises(TypeError, match=r"'r'.*'rank'"):
        make({"r": 4, "rank": 4, "lora_alpha": 8})
    with pytest.raises(TypeError, match=r"'lora_alpha'.*'alpha'"):
        make({"r": 4, "lora_alpha": 8, "alpha": 8})
    with pytest.raises(TypeError, match="'r'"):
        make({"lora_alpha": 8})
    with pytest.raises(TypeError, match="'lora_alpha'"):
        make({"r": 4})


def test_linen_clone_does_not_warn_again():
    with pytest.warns(DeprecationWarning):
        twin = LinenDoraDense(12, rank=4, alpha=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        params = twin.init(jax.random.key(0), _x())  # init and apply clone the module
        twin.apply(params, _x())
        assert twin.clone().r == 4


def test_constructors_are_keyword_only():
    for fn in (DoraDense.__init__, DoraDense.from_linear):
        params = list(inspect.signature(fn).parameters.values())
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert positional in (
            ["self", "in_features", "out_features"],
            ["cls", "linear"],
            ["linear"],
        )
    with pytest.raises(TypeError):
        DoraDense(16, 12, 4, 8, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError):
        DoraDense.from_linear(nnx.Linear(16, 12, rngs=nnx.Rngs(0)), 4, 8, rngs=nnx.Rngs(1))
    with pytest.raises(TypeError):
        LinenDoraDense(12, 4, 8)


def test_vocabulary_matches_dora_torch_linear():
    """The adapter keywords of the JAX layers are those of dora_torch.Linear."""
    torch_layer = pytest.importorskip("dora_torch").Linear
    peft = {"r", "lora_alpha", "use_rslora", "lora_dropout"}
    assert peft <= set(inspect.signature(torch_layer.__init__).parameters)
    for fn in (DoraDense.__init__, DoraDense.from_linear):
        assert peft <= set(inspect.signature(fn).parameters)
    assert peft <= {f.name for f in LinenDoraDense.__dataclass_fields__.values()}


# ------------------------------------------------------------------------------------------
# merge / unmerge in place (dora_torch.Linear's semantics), to_linear
# ------------------------------------------------------------------------------------------


def _trained(**kw):
    layer = DoraDense(16, 12, r=4, lora_alpha=8, rngs=nnx.Rngs(0), **kw)
    key_b, key_m = jax.random.split(jax.random.key(3))
    layer.lora_b.set_value(0.3 * jax.random.normal(key_b, (4, 12)))
    layer.magnitude.set_value(
        layer.magnitude.get_value() * (1 + 0.1 * jax.random.normal(key_m, (12,)))
    )
    return layer


def test_merge_folds_in_place_and_unmerge_restores():
    layer = _trained()
    x = _x()
    y = layer(x)
    kernel0 = np.array(layer.kernel.get_value())
    assert layer.merged is False
    assert layer.merge() is None
    assert layer.merged is True
    merged = np.array(layer.kernel.get_value())
    assert not np.allclose(merged, kernel0)
    expected = merge_weight(
        jnp.asarray(kernel0),
        layer.lora_a.get_value(),
        layer.lora_b.get_value(),
        layer.magnitude.get_value(),
        layer.scaling,
    )
    np.testing.assert_array_equal(merged, expected)
    # the merged layer is the plain dense layer x·K + bias, and gives the DoRA output
    np.testing.assert_allclose(layer(x), x @ merged + layer.bias.get_value(), rtol=1e-6)
    np.testing.assert_allclose(layer(x), y, rtol=1e-5, atol=1e-5)
    layer.merge()  # a no-op
    np.testing.assert_array_equal(layer.kernel.get_value(), merged)
    assert layer.unmerge() is None
    assert layer.merged is False
    np.testing.assert_allclose(layer.kernel.get_value(), kernel0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(layer(x), y, rtol=1e-5, atol=1e-5)
    restored = np.array(layer.kernel.get_value())
    layer.unmerge()  # a no-op
    np.testing.assert_array_equal(layer.kernel.get_value(), restored)


def test_merge_is_shared_with_the_wrapped_linear_and_jit_sees_it():
    lin = nnx.Linear(16, 12, rngs=nnx.Rngs(0))
    layer = DoraDense.from_linear(lin, r=4, lora_alpha=8, rngs=nnx.Rngs(1))
    layer.lora_b.set_value(0.2 * jnp.ones((4, 12)))
    x = _x()
    y = layer(x)
    layer.merge()
    np.testing.assert_array_equal(lin.kernel.get_value(), layer.kernel.get_value())
    np.testing.assert_allclose(lin(x), y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), y, rtol=1e-5, atol=1e-5)


def test_merge_clears_caches_and_refuses_norm_while_merged():
    layer = _trained()
    layer.cache_base_sq()
    layer.freeze_norm()
    layer.merge()
    assert layer.base_sq is None and layer.frozen_norm is None
    with pytest.raises(ValueError, match="unmerge"):
        layer.freeze_norm()
    layer.unmerge()
    layer.freeze_norm()


def test_unmerge_is_exact_in_float64():
    with jax.enable_x64(True):
        layer = DoraDense(16, 12, r=4, lora_alpha=8, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        layer.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(2), (4, 12), jnp.float64))
        kernel0 = np.array(layer.kernel.get_value())
        layer.merge()
        ref = S.merge(
            kernel0.T,
            np.asarray(layer.lora_a.get_value()).T,
            np.asarray(layer.lora_b.get_value()).T,
            np.asarray(layer.magnitude.get_value()),
            layer.scaling,
        ).T
        np.testing.assert_allclose(layer.kernel.get_value(), ref, rtol=1e-13, atol=1e-15)
        layer.unmerge()
        np.testing.assert_allclose(layer.kernel.get_value(), kernel0, rtol=1e-13, atol=1e-15)


def test_to_linear_returns_a_new_linear_and_leaves_the_layer():
    layer = _trained()
    x = _x()
    y = layer(x)
    kernel0 = np.array(layer.kernel.get_value())
    lin = layer.to_linear()
    assert isinstance(lin, nnx.Linear) and layer.merged is False
    np.testing.assert_array_equal(layer.kernel.get_value(), kernel0)
    np.testing.assert_allclose(lin(x), y, rtol=1e-5, atol=1e-5)
    layer.merge()
    np.testing.assert_array_equal(layer.to_linear().kernel.get_value(), layer.kernel.get_value())


# ------------------------------------------------------------------------------------------
# functional merge: merge_weight / unmerge_weight (dora_torch's names), merged_kernel deprecated
# ------------------------------------------------------------------------------------------


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((20, 9)) / np.sqrt(20)
    a = rng.standard_normal((20, 3)) / np.sqrt(20)
    b = rng.standard_normal((3, 9)) * 0.3
    m = np.linalg.norm(k + 1.5 * a @ b, axis=0) * (1 + 0.1 * rng.standard_normal(9))
    return k, a, b, m


def test_merge_weight_and_unmerge_weight_match_the_spec():
    k, a, b, m = _arrays()
    s = 1.5
    K, A, B, M = (jnp.asarray(v, jnp.float32) for v in (k, a, b, m))
    merged = merge_weight(K, A, B, M, s)
    ref = S.merge(k.T, a.T, b.T, m, s).T
    np.testing.assert_allclose(merged, ref, rtol=2e-6, atol=1e-7)
    n = dora_jax.factored_norm(K, A, B, s)
    np.testing.assert_allclose(merge_weight(K, A, B, M, s, n), merged, rtol=1e-7)
    back = unmerge_weight(merged, A, B, M, s, n)
    np.testing.assert_allclose(back, k, rtol=0, atol=2e-6)
    np.testing.assert_allclose(back, S.unmerge(ref.T, a.T, b.T, m, s, np.asarray(n)).T, atol=2e-6)
    with pytest.raises(ValueError, match="zero magnitude"):
        unmerge_weight(merged, A, B, M.at[2].set(0.0), s, n)
    assert dora_jax.merge_weight is merge_weight and dora_jax.unmerge_weight is unmerge_weight


def test_merged_kernel_is_a_deprecated_alias():
    k, a, b, m = (jnp.asarray(v, jnp.float32) for v in _arrays(1))
    with pytest.warns(DeprecationWarning, match="merge_weight"):
        old = dora_jax.merged_kernel(k, a, b, m, 2.0)
    np.testing.assert_array_equal(old, merge_weight(k, a, b, m, 2.0))


def test_linen_merge_and_unmerge_params():
    twin = LinenDoraDense(12, r=4, lora_alpha=8)
    x = _x()
    params = dict(twin.init(jax.random.key(0), x)["params"])
    params["lora_b"] = 0.3 * jax.random.normal(jax.random.key(5), (4, 12))
    y = twin.apply({"params": params}, x)
    dense = merge_params(params, scaling=twin.scaling)
    np.testing.assert_allclose(x @ dense["kernel"] + dense["bias"], y, rtol=1e-5, atol=1e-5)
    n = dora_jax.factored_norm(params["kernel"], params["lora_a"], params["lora_b"], twin.scaling)
    back = unmerge_params(dense, params, scaling=twin.scaling, norm=n)
    np.testing.assert_allclose(back["kernel"], params["kernel"], atol=2e-6)
    np.testing.assert_allclose(twin.apply({"params": back}, x), y, rtol=1e-5, atol=1e-5)
