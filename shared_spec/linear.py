"""The DoRA linear layer: forward and vector-Jacobian product (docs/design.md §1, §2, §4).

    n = ||W + s·B·A||_row        (treated as a constant by default: detached)
    g = m / max(n, eps)
    y = g ⊙ (x Wᵀ + s·(x Aᵀ) Bᵀ) + b

With adapter dropout (PEFT semantics, x_d = dropout(x)):

    y = (x Wᵀ + b) + (g − 1) ⊙ (x_d Wᵀ) + g ⊙ s·(x_d Aᵀ) Bᵀ

which equals the first form when x_d = x. Everything is float64.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .compose import EPS, magnitude_scale
from .norm import dense_norm
from .shapes import check_adapter, check_input, check_output_like, check_scaling


class DoraGrads(NamedTuple):
    """Gradients of a DoRA linear layer, each shaped like its primal.

    dx: [..., d_in]. With ``x_dropped`` given, dx covers only the path through x
    (the base product) and ``dx_dropped`` the path through the dropped input.
    dA [r, d_in], dB [d_out, r], dm [d_out], dbias [d_out] or None.
    """

    dx: np.ndarray
    dA: np.ndarray
    dB: np.ndarray
    dm: np.ndarray
    dbias: np.ndarray | None
    dx_dropped: np.ndarray | None = None


def _f64(t):
    return None if t is None else np.asarray(t, np.float64)


def _prepare(x, W, A, B, m, scaling, bias, x_dropped):
    _, d_in, _ = check_adapter(W, A, B, m, bias)
    check_input(x, d_in)
    if x_dropped is not None and np.shape(x_dropped) != np.shape(x):
        raise ValueError(
            f"x_dropped must have the shape of x {np.shape(x)}; got {np.shape(x_dropped)}"
        )
    s = check_scaling(scaling)
    x, W, A, B, m, bias, x_dropped = map(_f64, (x, W, A, B, m, bias, x_dropped))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d_in)
    xd2 = x2 if x_dropped is None else x_dropped.reshape(-1, d_in)
    return s, x, W, A, B, m, bias, lead, x2, xd2


def dora_linear(x, W, A, B, m, scaling, bias=None, *, x_dropped=None, eps: float = EPS):
    """DoRA forward for any leading dims.

    x [..., d_in], W [d_out, d_in], A [r, d_in], B [d_out, r], m [d_out],
    bias [d_out] or None, x_dropped like x or None. Returns float64 [..., d_out].
    """
    s, x, W, A, B, m, bias, lead, x2, xd2 = _prepare(x, W, A, B, m, scaling, bias, x_dropped)
    g = magnitude_scale(m, dense_norm(W, A, B, s), eps=eps)
    lora_d = (xd2 @ A.T) @ B.T
    if x_dropped is None:
        y = g * (x2 @ W.T + s * lora_d)
    else:
        y = x2 @ W.T + (g - 1.0) * (xd2 @ W.T) + g * s * lora_d
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, W.shape[0])


def dora_linear_vjp(
    x,
    W,
    A,
    B,
    m,
    scaling,
    dy,
    bias=None,
    *,
    x_dropped=None,
    exact_norm_grad: bool = False,
    eps: float = EPS,
) -> DoraGrads:
    """Gradients of ``sum(dy * dora_linear(...))``.

    By default the norm is detached (DoRA paper §4.3, PEFT). With
    ``exact_norm_grad=True`` the gradient through n is added (docs/design.md §2): with
    ``c_i = (dL/dn_i) / n_i``,

        dB += c ⊙_rows (s·U + s²·B G),   dA += s·(c ⊙_rows B)ᵀ W + s²·(Bᵀ diag(c) B) A

    where U = W Aᵀ and G = A Aᵀ. Rows clamped by eps get no gradient through n.
    """
    s, x, W, A, B, m, bias, lead, _, xd2 = _prepare(x, W, A, B, m, scaling, bias, x_dropped)
    d_out = W.shape[0]
    check_output_like(dy, lead, d_out)
    dy2 = np.asarray(dy, np.float64).reshape(-1, d_out)

    n = dense_norm(W, A, B, s)
    n_safe = np.maximum(n, eps)
    g = m / n_safe
    h_d = xd2 @ A.T
    inner_d = xd2 @ W.T + s * h_d @ B.T  # what g multiplies

    dyg = dy2 * g
    dm = np.sum(dy2 * inner_d, axis=0) / n_safe
    dx = dy2 @ W  # path through the base product on x
    dxd = (dy2 * (g - 1.0)) @ W + s * (dyg @ B) @ A
    dB = s * dyg.T @ h_d
    dA = s * (dyg @ B).T @ xd2
    dbias = None if bias is None else dy2.sum(axis=0)

    if exact_norm_grad:
        dn = -(m / n_safe**2) * np.sum(dy2 * inner_d, axis=0)
        c = np.where(n >= eps, dn / n_safe, 0.0)
        U = W @ A.T
        G = A @ A.T
        dB = dB + c[:, None] * (s * U + s * s * B @ G)
        dA = dA + s * (c[:, None] * B).T @ W + s * s * (B.T @ (c[:, None] * B)) @ A

    if x_dropped is None:
        return DoraGrads((dx + dxd).reshape(x.shape), dA, dB, dm, dbias, None)
    return DoraGrads(dx.reshape(x.shape), dA, dB, dm, dbias, dxd.reshape(x.shape))
