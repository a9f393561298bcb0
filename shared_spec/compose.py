"""Composition of base and adapter outputs (docs/design.md §3) and the eps policy.

Eps policy: the norm is clamped from below, ``g = m / max(n, eps)`` with
``eps = EPS = 1e-12`` (absolute, in the fp32/fp64 norm domain). A row whose
``W_i + s·(BA)_i`` is all zeros (they exist in real checkpoints) then has a
finite g and, since its inner product is exactly zero, a finite output equal to
the bias. Rows with n ≥ eps are untouched, so results match PEFT's (which has no
eps) everywhere PEFT's are finite. Gradients through the clamp are zero.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-12


def _identity(a):
    return a


def magnitude_scale(magnitude, norm, *, eps: float = EPS) -> np.ndarray:
    """g = m / max(n, eps): the per-row factor DoRA applies, float64 [d_out]."""
    m = np.asarray(magnitude, np.float64)
    n = np.asarray(norm, np.float64)
    if m.shape != n.shape:
        raise ValueError(f"magnitude {m.shape} and norm {n.shape} must have the same shape")
    return m / np.maximum(n, eps)


def compose(base, lora, magnitude, norm, scaling, *, eps: float = EPS, round_fn=_identity):
    """Stable composition ``g ⊙ (base + s·lora)`` with a single final rounding.

    base = x Wᵀ [..., d_out] (no bias), lora = (x Aᵀ) Bᵀ [..., d_out],
    magnitude/norm [d_out]. Everything is evaluated in float64 (standing for the
    fp32 accumulators of the kernels) and rounded once by ``round_fn``.
    """
    g = magnitude_scale(magnitude, norm, eps=eps)
    base = np.asarray(base, np.float64)
    lora = np.asarray(lora, np.float64)
    return round_fn(g * (base + float(scaling) * lora))


def compose_naive(base, lora, magnitude, norm, scaling, *, eps: float = EPS, round_fn=_identity):
    """The composition as common implementations write it, kept to show its flaw.

    Returns the adapter's *delta* ``(g − 1)·base + g·s·lora`` with ``round_fn``
    applied after every operation (and to m, n and g), as happens when the whole
    expression runs in the activation dtype. In bf16, g within 2⁻⁹ of 1 rounds to
    exactly 1, so ``g − 1`` is 0 and the magnitude's effect on the output is lost.
    The caller adds it to the (rounded) base-plus-bias output.
    """
    r = round_fn
    m = r(np.asarray(magnitude, np.float64))
    n = r(np.maximum(np.asarray(norm, np.float64), eps))
    g = r(m / n)
    base = r(np.asarray(base, np.float64))
    lora = r(np.asarray(lora, np.float64))
    return r(r(r(g - 1.0) * base) + r(r(g * lora) * float(scaling)))
