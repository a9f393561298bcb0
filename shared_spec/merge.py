"""Merging the adapter into the frozen weight, and undoing it."""

from __future__ import annotations

import numpy as np

from .compose import EPS, magnitude_scale
from .norm import dense_norm
from .shapes import check_adapter, check_scaling


def merge(W, A, B, m, scaling, *, eps: float = EPS) -> np.ndarray:
    """The merged weight ``g ⊙_rows (W + s·B·A)`` with g = m / max(n, eps).

    W [d_out, d_in], A [r, d_in], B [d_out, r], m [d_out]; returns float64
    [d_out, d_in]. ``x @ merge(...).T + b`` equals ``dora_linear(x, ...)``.
    """
    check_adapter(W, A, B, m)
    s = check_scaling(scaling)
    W, A, B = (np.asarray(t, np.float64) for t in (W, A, B))
    g = magnitude_scale(m, dense_norm(W, A, B, s), eps=eps)
    return g[:, None] * (W + s * (B @ A))


def unmerge(W_merged, A, B, m, scaling, norm, *, eps: float = EPS) -> np.ndarray:
    """Recover W from a merged weight.

    ``norm`` [d_out] is the norm n of the original ``W + s·B·A`` (it cannot be read
    back from the merged weight); implementations cache it at merge time.
    Raises ValueError if a row has g = 0 (m_i = 0), which merging cannot undo.
    """
    check_adapter(W_merged, A, B, m)
    s = check_scaling(scaling)
    g = magnitude_scale(m, norm, eps=eps)
    if np.any(g == 0):
        rows = np.flatnonzero(g == 0)[:8].tolist()
        raise ValueError(f"cannot unmerge rows with zero magnitude (m == 0), e.g. rows {rows}")
    W_merged, A, B = (np.asarray(t, np.float64) for t in (W_merged, A, B))
    return W_merged / g[:, None] - s * (B @ A)
