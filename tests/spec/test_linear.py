import numpy as np
import pytest

import shared_spec as S
from shared_spec import cases

PARAMS = ("x", "A", "B", "m")


def _loss(d, exact, **over):
    """L = sum(dy * y); with exact=False the norm is frozen at the unperturbed params."""
    args = {"x": d.x, "W": d.W, "A": d.A, "B": d.B, "m": d.m} | over
    if exact:
        y = S.dora_linear(args["x"], args["W"], args["A"], args["B"], args["m"], d.scaling, d.bias)
    else:
        n = S.dense_norm(d.W, d.A, d.B, d.scaling)
        g = S.magnitude_scale(args["m"], n)
        x2 = args["x"].reshape(-1, d.W.shape[1])
        inner = x2 @ args["W"].T + d.scaling * (x2 @ args["A"].T) @ args["B"].T
        y = (g * inner + (0 if d.bias is None else d.bias)).reshape(d.dy.shape)
    return float(np.sum(d.dy * y))


def _finite_difference(d, name, exact, h=1e-6):
    p = getattr(d, name)
    grad = np.zeros_like(p)
    for idx in np.ndindex(p.shape):
        plus, minus = p.copy(), p.copy()
        plus[idx] += h
        minus[idx] -= h
        grad[idx] = (_loss(d, exact, **{name: plus}) - _loss(d, exact, **{name: minus})) / (2 * h)
    return grad


@pytest.mark.parametrize("exact", [False, True], ids=["detached", "exact"])
@pytest.mark.parametrize("case", ["odd_shapes", "batched_3d", "rank_exceeds_d_in", "rslora"])
def test_vjp_matches_finite_differences(case, exact):
    d = cases.get(case).make(11)
    grads = S.dora_linear_vjp(
        d.x, d.W, d.A, d.B, d.m, d.scaling, d.dy, d.bias, exact_norm_grad=exact
    )
    got = {"x": grads.dx, "A": grads.dA, "B": grads.dB, "m": grads.dm}
    for name in PARAMS:
        fd = _finite_difference(d, name, exact)
        np.testing.assert_allclose(got[name], fd, rtol=1e-6, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(grads.dbias, d.dy.reshape(-1, d.W.shape[0]).sum(0))


def test_exact_mode_differs_only_in_norm_term():
    d = cases.get("magnitude_perturbed").make(5)
    det = S.dora_linear_vjp(d.x, d.W, d.A, d.B, d.m, d.scaling, d.dy, d.bias)
    ex = S.dora_linear_vjp(d.x, d.W, d.A, d.B, d.m, d.scaling, d.dy, d.bias, exact_norm_grad=True)
    # x and m do not enter the norm: identical.
    np.testing.assert_array_equal(ex.dx, det.dx)
    np.testing.assert_array_equal(ex.dm, det.dm)
    # A and B do: the difference is exactly the docs/design.md §2 correction.
    s = d.scaling
    n = S.dense_norm(d.W, d.A, d.B, s)
    x2, dy2 = d.x.reshape(-1, d.W.shape[1]), d.dy.reshape(-1, d.W.shape[0])
    inner = x2 @ d.W.T + s * (x2 @ d.A.T) @ d.B.T
    c = -(d.m / n**2) * np.sum(dy2 * inner, axis=0) / n
    U, G = d.W @ d.A.T, d.A @ d.A.T
    np.testing.assert_allclose(ex.dB - det.dB, c[:, None] * (s * U + s * s * d.B @ G), atol=1e-12)
    corr_A = s * (c[:, None] * d.B).T @ d.W + s * s * (d.B.T @ (c[:, None] * d.B)) @ d.A
    np.testing.assert_allclose(ex.dA - det.dA, corr_A, atol=1e-12)
    assert np.abs(ex.dB - det.dB).max() > 1e-3  # the correction is not negligible here


def test_dropout_form_reduces_to_plain_form():
    d = cases.get("basic").make(2)
    y = S.dora_linear(d.x, d.W, d.A, d.B, d.m, d.scaling, d.bias)
    y_d = S.dora_linear(d.x, d.W, d.A, d.B, d.m, d.scaling, d.bias, x_dropped=d.x)
    np.testing.assert_allclose(y_d, y, rtol=1e-12, atol=1e-12)
    g = S.dora_linear_vjp(d.x, d.W, d.A, d.B, d.m, d.scaling, d.dy, d.bias)
    gd = S.dora_linear_vjp(d.x, d.W, d.A, d.B, d.m, d.scaling, d.dy, d.bias, x_dropped=d.x)
    np.testing.assert_allclose(gd.dx + gd.dx_dropped, g.dx, atol=1e-12)
    np.testing.assert_allclose(gd.dA, g.dA, atol=1e-12)


def test_dropout_form_gradients_by_finite_differences():
    d = cases.get("odd_shapes").make(4)
    rng = np.random.default_rng(0)
    xd = d.x * (rng.random(d.x.shape) > 0.3) / 0.7

    def loss(x, xd_):
        return float(
            np.sum(d.dy * S.dora_linear(x, d.W, d.A, d.B, d.m, d.scaling, d.bias, x_dropped=xd_))
        )

    g = S.dora_linear_vjp(d.x, d.W, d.A, d.B, d.m, d.scaling, d.dy, d.bias, x_dropped=xd)
    h = 1e-6
    for which, grad in (("x", g.dx), ("xd", g.dx_dropped)):
        fd = np.zeros_like(d.x)
        for idx in np.ndindex(d.x.shape):
            e = np.zeros_like(d.x)
            e[idx] = h
            if which == "x":
                fd[idx] = (loss(d.x + e, xd) - loss(d.x - e, xd)) / (2 * h)
            else:
                fd[idx] = (loss(d.x, xd + e) - loss(d.x, xd - e)) / (2 * h)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-6, err_msg=which)


def test_fresh_adapter_reproduces_base_layer():
    d = cases.get("fresh_adapter").make(0)
    y = S.dora_linear(d.x, d.W, d.A, d.B, d.m, d.scaling, d.bias)
    np.testing.assert_allclose(y, d.x @ d.W.T + d.bias, rtol=1e-12, atol=1e-12)


def test_zero_base_row_is_finite():
    d = cases.get("zero_base_row").make(0)
    y = S.dora_linear(d.x, d.W, d.A, d.B, d.m, d.scaling, d.bias)
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[:, 0], np.broadcast_to(d.bias[0], y[:, 0].shape))
    for exact in (False, True):
        gr = S.dora_linear_vjp(
            d.x, d.W, d.A, d.B, d.m, d.scaling, d.dy, d.bias, exact_norm_grad=exact
        )
        for t in gr:
            assert t is None or np.all(np.isfinite(t))


@pytest.mark.parametrize("case", ["no_tokens", "one_token", "batched_3d"])
def test_leading_dims(case):
    d = cases.get(case).make(0)
    y = S.dora_linear(d.x, d.W, d.A, d.B, d.m, d.scaling, d.bias)
    assert y.shape == (*d.x.shape[:-1], d.W.shape[0])
    g = S.dora_linear_vjp(d.x, d.W, d.A, d.B, d.m, d.scaling, d.dy, d.bias)
    assert g.dx.shape == d.x.shape


def test_bad_input_shapes():
    d = cases.get("basic").make(0)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., d_in\] with d_in=64"):
        S.dora_linear(d.x[:, :10], d.W, d.A, d.B, d.m, d.scaling)
    with pytest.raises(ValueError, match="m must have shape"):
        S.dora_linear(d.x, d.W, d.A, d.B, d.m[:3], d.scaling)
    with pytest.raises(ValueError, match="bias must have shape"):
        S.dora_linear(d.x, d.W, d.A, d.B, d.m, d.scaling, d.bias[:-1])
    with pytest.raises(ValueError, match="dy must have shape"):
        S.dora_linear_vjp(d.x, d.W, d.A, d.B, d.m, d.scaling, d.dy[:2])
    with pytest.raises(ValueError, match="x_dropped"):
        S.dora_linear(d.x, d.W, d.A, d.B, d.m, d.scaling, x_dropped=d.x[:2])
