"""Dtypes: float16 in the spec matrix (with a zero-norm column), the adapter dtype rule (PEFT's),
and the adapter precision rule inside the norm (A rounded to the kernel's dtype, B never below
f32)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shared_spec as S
from dora_jax import DoraDense, factored_norm
from dora_jax.functional import dora_dense
from dora_jax.linen import DoraDense as LinenDoraDense
from shared_spec.cases import CASES

from .compose_check import MOSAIC_ZERO_ROWS
from .spec_check import check_case, f64

F16 = jnp.float16
EPS16 = float(jnp.finfo(F16).eps)

# ------------------------------------------------------------------------------------------
# float16 in the dtype matrix (tests/jax/test_spec_cases.py covers f32 and bf16)
# ------------------------------------------------------------------------------------------

# The zero-norm case is judged separately below: every plain-f16 baseline is NaN there (the
# very bug), so the shared "k × baseline error" rule has nothing to compare against.
F16_NAMES = [
    name for name, case in CASES.items() if "large" not in case.tags and not case.zero_rows
]


@pytest.mark.parametrize("name", F16_NAMES)
def test_float16_matches_spec(name):
    check_case(CASES[name], F16, impl="xla")


def _rel(actual, ref) -> float:
    a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    r = np.asarray(ref, np.float64)
    assert a.shape == r.shape
    denom = np.linalg.norm(r)
    return float(np.linalg.norm(a - r) / (denom if denom > 0 else 1.0))


def _zero_case(impl):
    return MOSAIC_ZERO_ROWS if impl == "mosaic" else CASES["zero_base_row"]


def _zero_row_case(adapter_dtype, impl):
    """zero_base_row (its Mosaic-tiled twin for impl "mosaic") with f16 activations and
    kernel; adapters, magnitude and bias in ``adapter_dtype``. Columns 0 and 5 of K and b are
    zero: n = 0, g = m/eps ≈ 5e11."""
    d = _zero_case(impl).make(0)
    k, a, b = S.to_flax_layout(d.W, d.A, d.B)
    x, k = jnp.asarray(d.x, F16), jnp.asarray(k, F16)
    a, b, m, bias = (jnp.asarray(v, adapter_dtype) for v in (a, b, d.m, d.bias))
    return d, x, k, a, b, m, bias, jnp.asarray(d.dy, F16)


def _spec(d, x, k, a, b, m, bias, dy, **kw):
    W, A, B = S.from_flax_layout(f64(k), f64(a), f64(b))
    y = S.dora_linear(f64(x), W, A, B, f64(m), d.scaling, f64(bias))
    grads = S.dora_linear_vjp(f64(x), W, A, B, f64(m), d.scaling, f64(dy), f64(bias), **kw)
    return y, grads


@pytest.mark.parametrize("exact", [False, True], ids=["detached", "exact"])
@pytest.mark.parametrize("impl", ["xla", "mosaic"])
def test_float16_zero_norm_column_gives_finite_gradients(impl, exact):
    """f16 activations over f32 adapters (PEFT's default for an f16 base): g·dy overflows f16 in
    the zero columns; saturated, every gradient is finite and matches the spec to f16 rounding.
    """
    d, x, k, a, b, m, bias, dy = _zero_row_case(jnp.float32, impl)

    def f(x, a, b, m, bias):
        return dora_dense(x, k, a, b, m, d.scaling, bias, impl=impl, exact_norm_grad=exact)

    y, pull = jax.vjp(f, x, a, b, m, bias)
    grads = pull(dy)
    ref_y, ref = _spec(d, x, k, a, b, m, bias, dy, exact_norm_grad=exact)
    assert y.dtype == F16 and bool(jnp.all(jnp.isfinite(y)))
    assert _rel(y, ref_y) <= 2 * EPS16
    refs = (ref.dx, ref.dA.T, ref.dB.T, ref.dm, ref.dbias)
    for label, g, r in zip(("dx", "da", "db", "dm", "dbias"), grads, refs):
        assert bool(jnp.all(jnp.isfinite(g))), f"{label} has NaN/inf"
        # f16 roundings of the operands and products (the saturated g·dy only ever meets
        # zeros of K and b); measured ≤ 0.47 eps
        assert _rel(g, r) <= 2 * EPS16, f"{label}: {_rel(g, r):.3g}"


@pytest.mark.parametrize("impl", ["xla", "mosaic"])
def test_float16_zero_norm_column_all_f16_has_no_nan(impl):
    """Everything in f16: dx, da, dm and dbias stay finite and right; db of the zero columns
    (|db| ≈ 1e12 in exact arithmetic) cannot be represented and may round to ±inf, but is
    never NaN; every other column of db matches the spec."""
    d, x, k, a, b, m, bias, dy = _zero_row_case(F16, impl)
    y, pull = jax.vjp(
        lambda *p: dora_dense(*p[:1], k, *p[1:4], d.scaling, p[4], impl=impl), x, a, b, m, bias
    )
    dx, da, db, dm, dbias = pull(dy)
    _, ref = _spec(d, x, k, a, b, m, bias, dy)
    assert bool(jnp.all(jnp.isfinite(y)))
    for label, g, r in (
        ("dx", dx, ref.dx),
        ("da", da, ref.dA.T),
        ("dm", dm, ref.dm),
        ("dbias", dbias, ref.dbias),
    ):
        assert bool(jnp.all(jnp.isfinite(g))), f"{label} has NaN/inf"
        assert _rel(g, r) <= 2 * EPS16, f"{label}: {_rel(g, r):.3g}"
    assert not bool(jnp.any(jnp.isnan(db)))
    live = np.setdiff1d(np.arange(k.shape[1]), _zero_case(impl).zero_rows)
    assert _rel(db[:, live], ref.dB.T[:, live]) <= 2 * EPS16


def test_float16_zero_norm_column_with_dropout():
    """The dropout form scales dy by g − 1 = (m − n)/n ≈ m/eps too: saturated as well."""
    impl = "xla"
    d, x, k, a, b, m, bias, dy = _zero_row_case(jnp.float32, impl)
    key = jax.random.key(0)

    def f(x, a, b, m, bias):
        return dora_dense(
            x,
            k,
            a,
            b,
            m,
            d.scaling,
            bias,
            impl=impl,
            dropout_rate=0.25,
            dropout_rng=key,
            deterministic=False,
        )

    y, pull = jax.vjp(f, x, a, b, m, bias)
    assert bool(jnp.all(jnp.isfinite(y)))
    for label, g in zip(("dx", "da", "db", "dm", "dbias"), pull(dy)):
        assert bool(jnp.all(jnp.isfinite(g))), f"{label} has NaN/inf"


def test_float16_layer_end_to_end():
    """DoraDense over an f16 nnx.Linear with a dead output column: f32 adapters, finite grads."""
    lin = nnx.Linear(32, 12, param_dtype=F16, rngs=nnx.Rngs(0))
    lin.kernel.set_value(lin.kernel.get_value().at[:, 3].set(0))
    layer = DoraDense.from_linear(lin, r=4, lora_alpha=8, rngs=nnx.Rngs(1))
    assert layer.lora_a.get_value().dtype == jnp.float32
    layer.magnitude.set_value(layer.magnitude.get_value().at[3].set(0.5))
    x = jax.random.normal(jax.random.key(2), (8, 32), F16)
    grads = nnx.grad(lambda mod: jnp.sum(mod(x)), argnums=nnx.DiffState(0, nnx.LoRAParam))(layer)
    for leaf in jax.tree.leaves(grads):
        assert bool(jnp.all(jnp.isfinite(leaf)))
    dx = jax.grad(lambda x: jnp.sum(layer(x).astype(jnp.float32)))(x)
    assert bool(jnp.all(jnp.isfinite(dx)))


# ------------------------------------------------------------------------------------------
# Adapter dtype: PEFT's rule (the kernel's dtype; f32 over f16/bf16), explicit override wins
# ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _maybe_x64(dtype):
    if jnp.dtype(dtype) != jnp.float64 or jax.config.jax_enable_x64:
        yield
        return
    with jax.enable_x64(True):
        yield


RULE = [
    (jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.float32),
    (jnp.float16, jnp.float32),
    (jnp.float64, jnp.float64),
]
RULE_IDS = ["f32", "bf16", "f16", "f64"]


def _adapter_dtypes(layer):
    return {
        jnp.dtype(getattr(layer, n).get_value().dtype) for n in ("lora_a", "lora_b", "magnitude")
    }


@pytest.mark.parametrize(("kernel_dtype", "expected"), RULE, ids=RULE_IDS)
def test_from_linear_adapter_dtype_follows_peft(kernel_dtype, expected):
    with _maybe_x64(kernel_dtype):
        lin = nnx.Linear(16, 12, param_dtype=kernel_dtype, rngs=nnx.Rngs(0))
        layer = DoraDense.from_linear(lin, r=4, lora_alpha=8, rngs=nnx.Rngs(1))
        assert _adapter_dtypes(layer) == {jnp.dtype(expected)}
        assert layer.kernel.get_value().dtype == jnp.dtype(kernel_dtype)
        assert layer(jnp.ones((2, 16), kernel_dtype)).dtype == jnp.dtype(kernel_dtype)
        explicit = DoraDense.from_linear(
            lin, r=4, lora_alpha=8, adapter_dtype=jnp.bfloat16, rngs=nnx.Rngs(1)
        )
        assert _adapter_dtypes(explicit) == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize(("kernel_dtype", "expected"), RULE, ids=RULE_IDS)
def test_constructor_adapter_dtype_follows_peft(kernel_dtype, expected):
    with _maybe_x64(kernel_dtype):
        layer = DoraDense(16, 12, r=4, lora_alpha=8, param_dtype=kernel_dtype, rngs=nnx.Rngs(0))
        assert _adapter_dtypes(layer) == {jnp.dtype(expected)}
        explicit = DoraDense(
            16,
            12,
            r=4,
            lora_alpha=8,
            param_dtype=kernel_dtype,
            adapter_dtype=jnp.float16,
            rngs=nnx.Rngs(0),
        )
        assert _adapter_dtypes(explicit) == {jnp.dtype(jnp.float16)}


@pytest.mark.parametrize(("kernel_dtype", "expected"), RULE, ids=RULE_IDS)
def test_linen_adapter_dtype_follows_peft(kernel_dtype, expected):
    with _maybe_x64(kernel_dtype):
        x = jnp.ones((2, 16), kernel_dtype)
        params = LinenDoraDense(12, r=4, lora_alpha=8, param_dtype=kernel_dtype).init(
            jax.random.key(0), x
        )["params"]
        assert {jnp.dtype(params[n].dtype) for n in ("lora_a", "lora_b", "magnitude")} == {
            jnp.dtype(expected)
        }
        override = LinenDoraDense(
            12, r=4, lora_alpha=8, param_dtype=kernel_dtype, adapter_dtype=jnp.bfloat16
        )
        params = override.init(jax.random.key(0), x)["params"]
        assert params["lora_b"].dtype == jnp.bfloat16


# ------------------------------------------------------------------------------------------
# The adapter precision rule inside the norm (shared with dora_torch)
# ------------------------------------------------------------------------------------------


def _rule_reference(kernel, lora_a, lora_b, scaling):
    """The norm the rule defines, in float64: lora_a rounded to the kernel's dtype (for U and G
    alike), lora_b exactly as given (f32), the kernel as stored."""
    a = np.asarray(jnp.asarray(lora_a).astype(kernel.dtype).astype(jnp.float32), np.float64)
    k = np.asarray(kernel.astype(jnp.float32), np.float64)
    b = np.asarray(lora_b.astype(jnp.float32), np.float64)
    W, A, B = S.from_flax_layout(k, a, b)
    return S.factored_norm(W, A, B, scaling)


@pytest.mark.parametrize("kernel_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_norm_rounds_a_to_the_kernel_dtype_but_not_b(kernel_dtype):
    """A low-precision kernel with f32 adapters: the norm equals the rule's float64 value to f32
    accuracy (off the GPU, where G·b stays an f32 product; on GPUs it is bf16x3, tested
    below). Rounding b to the kernel's dtype as well (the old behaviour) is ~1e-3 off."""
    rng = np.random.default_rng(7)
    d_in, d_out, r, s = 96, 40, 8, 1.7
    kernel = jnp.asarray(rng.standard_normal((d_in, d_out)) / np.sqrt(d_in), kernel_dtype)
    lora_a = jnp.asarray(rng.standard_normal((d_in, r)) / np.sqrt(d_in), jnp.float32)
    lora_b = jnp.asarray(rng.standard_normal((r, d_out)) / (s * np.sqrt(r)), jnp.float32)
    n = factored_norm(kernel, lora_a, lora_b, s, impl="xla")
    assert n.dtype == jnp.float32
    ref = _rule_reference(kernel, lora_a, lora_b, s)
    np.testing.assert_allclose(np.asarray(n, np.float64), ref, rtol=1e-6)
    # the rule is not vacuous here: b rounded to the kernel's dtype moves the norm visibly
    b_low = lora_b.astype(kernel_dtype)
    assert np.max(np.abs(_rule_reference(kernel, lora_a, b_low, s) / ref - 1)) > 1e-5
    # and a is really rounded: the unrounded-a norm differs from the rule's
    k64 = np.asarray(kernel.astype(jnp.float32), np.float64)
    W, A, B = S.from_flax_layout(k64, np.asarray(lora_a, np.float64), np.asarray(lora_b))
    assert np.max(np.abs(S.factored_norm(W, A, B, s) / ref - 1)) > 1e-5


# ------------------------------------------------------------------------------------------
# G·b from bf16 pairs (config.NORM_GEMM_BF16X3: GPUs, 16-bit kernels)
# ------------------------------------------------------------------------------------------


def _gram_and_b(r, d_out, b_dtype, seed=3):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((200, r)) / np.sqrt(200)
    gram = jnp.asarray(a.T @ a, jnp.float32)  # symmetric, like aᵀa
    b = jnp.asarray(rng.standard_normal((r, d_out)) * np.exp(rng.uniform(-4, 2, d_out)), b_dtype)
    return gram, b


@pytest.mark.parametrize("b_dtype", [jnp.float32, jnp.bfloat16, F16], ids=["f32", "bf16", "f16"])
def test_bf16x3_gram_times_b_is_within_its_bound(b_dtype):
    """Every entry within 3·2⁻¹⁶ Σ_k |G_ik||b_kj| (+ f32 accumulation) of the float64 product,
    where one bf16 product (the bound it improves on) is off by ~2⁻⁹ of the same sum."""
    from dora_jax.xla_ops import gram_times_b

    r, d_out = 24, 300
    gram, b = _gram_and_b(r, d_out, b_dtype)
    g64, b64 = np.asarray(gram, np.float64), np.asarray(b.astype(jnp.float32), np.float64)
    exact, scale = g64 @ b64, np.abs(g64) @ np.abs(b64)
    got = np.asarray(jax.jit(lambda g, b: gram_times_b(g, b, bf16x3=True))(gram, b), np.float64)
    bound = (3 * 2.0**-16 + 3 * r * 2.0**-24) * scale
    assert np.all(np.abs(got - exact) <= bound)
    one_bf16 = np.asarray(
        jnp.dot(
            gram.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32
        ),
        np.float64,
    )
    assert np.max(np.abs(one_bf16 - exact) / scale) > 8 * np.max(np.abs(got - exact) / scale)


def test_bf16x3_needs_an_f32_assembly(x64):
    from dora_jax.xla_ops import gram_times_b

    gram, b = _gram_and_b(4, 8, jnp.float32)
    with pytest.raises(ValueError, match="bf16x3 needs an f32 assembly; got float64"):
        gram_times_b(gram.astype(jnp.float64), b, bf16x3=True)


BF16X3_NORM_CASES = [
    (jnp.bfloat16, jnp.float32, 3),
    (jnp.bfloat16, jnp.bfloat16, 2),
    (F16, jnp.float32, 3),
    (jnp.float32, jnp.float32, 0),
]
BF16X3_NORM_IDS = ["bf16-f32b", "bf16-bf16b", "f16-f32b", "f32"]


def check_bf16x3_norm(kernel_dtype, b_dtype, blocks, *, d_in=96, d_out=40, r=8, s=1.7):
    """Traced for a GPU, the norm of a 16-bit kernel forms G·b as one bf16 GEMM over
    ``blocks`` stacked copies of the rank and stays within the bf16x3 bound of the rule's
    float64 norm; an f32 kernel (``blocks`` 0) keeps the f32 product (its value is not
    checked here: on the GPU its U = aᵀK runs at XLA's default f32 precision, TF32)."""
    rng = np.random.default_rng(7)
    kernel = jnp.asarray(rng.standard_normal((d_in, d_out)) / np.sqrt(d_in), kernel_dtype)
    lora_a = jnp.asarray(rng.standard_normal((d_in, r)) / np.sqrt(d_in), jnp.float32)
    lora_b = jnp.asarray(rng.standard_normal((r, d_out)) / (s * np.sqrt(r)), b_dtype)
    fn = jax.jit(lambda k, a, b: factored_norm(k, a, b, s, impl="xla"))
    text = fn.lower(kernel, lora_a, lora_b).as_text()
    gb_dot = f"tensor<{r}x{blocks * r}xbf16>, tensor<{blocks * r}x{d_out}xbf16>"
    assert (gb_dot in text) == (blocks > 0), text
    if not blocks:
        assert f"tensor<{r}x{r}xf32>, tensor<{r}x{d_out}xf32>" in text, text
        return
    n = np.asarray(fn(kernel, lora_a, lora_b), np.float64)
    ref = _rule_reference(kernel, lora_a, lora_b, s)
    # n² moves by at most s²·3·2⁻¹⁶·|b|ᵀ|G||b| (+ f32 rounding), so n by half that over n²
    a = np.asarray(lora_a.astype(kernel_dtype).astype(jnp.float32), np.float64)
    b64 = np.asarray(lora_b.astype(jnp.float32), np.float64)
    gram_term = np.sum(np.abs(b64) * (np.abs(a.T @ a) @ np.abs(b64)), axis=0)
    rtol = (s * s * 3 * 2.0**-16 * gram_term) / (2 * ref * ref) + 1e-6
    assert np.all(np.abs(n - ref) <= rtol * ref)


@pytest.mark.parametrize(
    ("kernel_dtype", "b_dtype", "blocks"), BF16X3_NORM_CASES, ids=BF16X3_NORM_IDS
)
def test_norm_takes_bf16x3_on_gpus_for_16_bit_kernels(monkeypatch, kernel_dtype, b_dtype, blocks):
    """``check_bf16x3_norm`` on the CPU with the platform patched to "gpu" (XLA's CPU backend
    runs the same ops; ``test_gpu.py`` runs it compiled for the GPU). Off the GPU nothing
    changes (the test above)."""
    from dora_jax import config

    monkeypatch.setattr(config, "current_platform", lambda: "gpu")
    check_bf16x3_norm(kernel_dtype, b_dtype, blocks)


@pytest.mark.parametrize("exact_norm_grad", [False, True], ids=["detached", "exact"])
@pytest.mark.parametrize("name", ["odd_shapes", "rank_one", "no_tokens", "one_token", "rslora"])
def test_bf16x3_norm_matches_spec_forward_and_backward(monkeypatch, name, exact_norm_grad):
    """The layer with its norm's G·b as bf16x3 (platform patched to "gpu") against shared_spec:
    forward and every gradient, the exact norm gradient's w = s·U + s²·G·b included, on odd
    shapes, r = 1 and T = 0 / 1, within the bf16 tolerance the XLA path is held to."""
    from dora_jax import config

    monkeypatch.setattr(config, "current_platform", lambda: "gpu")
    check_case(CASES[name], jnp.bfloat16, impl="xla", exact_norm_grad=exact_norm_grad)
