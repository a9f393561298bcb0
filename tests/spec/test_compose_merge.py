import numpy as np
import pytest

import shared_spec as S
from shared_spec import cases
from shared_spec.precision import round_to_bfloat16


def test_merge_matches_forward_and_unmerge_inverts():
    d = cases.get("magnitude_perturbed").make(7)
    Wm = S.merge(d.W, d.A, d.B, d.m, d.scaling)
    y = S.dora_linear(d.x, d.W, d.A, d.B, d.m, d.scaling, d.bias)
    np.testing.assert_allclose(d.x @ Wm.T + d.bias, y, rtol=1e-12, atol=1e-12)
    n = S.dense_norm(d.W, d.A, d.B, d.scaling)
    np.testing.assert_allclose(S.unmerge(Wm, d.A, d.B, d.m, d.scaling, n), d.W, atol=1e-12)


def test_unmerge_rejects_zero_magnitude():
    d = cases.get("basic").make(0)
    m = d.m.copy()
    m[3] = 0.0
    Wm = S.merge(d.W, d.A, d.B, m, d.scaling)
    with pytest.raises(ValueError, match="zero magnitude"):
        S.unmerge(Wm, d.A, d.B, m, d.scaling, S.dense_norm(d.W, d.A, d.B, d.scaling))


def test_layout_round_trip():
    d = cases.get("odd_shapes").make(0)
    kernel, a, b = S.to_flax_layout(d.W, d.A, d.B)
    assert kernel.shape == (37, 53) and a.shape == (37, 5) and b.shape == (5, 53)
    W, A, B = S.from_flax_layout(kernel, a, b)
    np.testing.assert_array_equal(W, d.W)
    np.testing.assert_array_equal(A, d.A)
    np.testing.assert_array_equal(B, d.B)
    with pytest.raises(ValueError, match="rank mismatch"):
        S.from_flax_layout(kernel, a, b[:3])


def test_magnitude_scale_eps_policy():
    g = S.magnitude_scale(np.array([1.0, 0.5, 0.0]), np.array([2.0, 0.0, 0.0]))
    assert g[0] == 0.5 and np.isfinite(g[1]) and g[1] == 0.5 / S.EPS and g[2] == 0.0


def test_round_to_bfloat16():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-9, -3.14159, 0.0, np.inf, np.nan])
    r = round_to_bfloat16(x)
    np.testing.assert_array_equal(r[:5], [1.0, 1.0, 1.0 + 2**-7, -3.140625, 0.0])
    assert r[5] == np.inf and np.isnan(r[6])


def test_naive_bf16_compose_loses_magnitude_stable_keeps_it():
    """Near g ≈ 1 the naive form's bf16 ``g − 1`` is exactly 0: the trained magnitude vanishes.

    g = 1.003 is representable in fp32 but rounds to 1.0 in bf16 (spacing 2⁻⁷ above 1).
    We recover the effective g per row by least squares of (y − lora part) on base.
    """
    rng = np.random.default_rng(0)
    T, d = 4096, 8
    base = rng.standard_normal((T, d))
    lora = np.zeros((T, d))  # isolate the magnitude's effect
    n = np.full(d, 1.7)
    g_true = 1.0 + np.linspace(2.5e-3, 3.5e-3, d)
    m = g_true * n

    stable = S.compose(base, lora, m, n, 1.0, round_fn=round_to_bfloat16)
    naive = round_to_bfloat16(
        round_to_bfloat16(base) + S.compose_naive(base, lora, m, n, 1.0, round_fn=round_to_bfloat16)
    )

    def fitted_g(y):
        return np.sum(y * base, axis=0) / np.sum(base * base, axis=0)

    np.testing.assert_allclose(fitted_g(stable), g_true, atol=2e-4)  # kept
    # Lost: the naive output is exactly the (rounded) base layer, g fits as 1.
    np.testing.assert_array_equal(naive, round_to_bfloat16(base))
    np.testing.assert_allclose(fitted_g(naive), np.ones(d), atol=2e-4)
    assert np.all(fitted_g(naive) < g_true - 2e-3)
    # In float64 both forms agree: the difference is only rounding.
    exact_naive = base + S.compose_naive(base, lora, m, n, 1.0)
    np.testing.assert_allclose(exact_naive, S.compose(base, lora, m, n, 1.0), rtol=1e-12)
