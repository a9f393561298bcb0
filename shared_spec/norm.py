"""The DoRA weight norm: dense baseline and the factored form (docs/design.md §2).

For each output row i (PyTorch layout, norm over d_in):

    n_i² = ||W_i + s·(B A)_i||²
         = ||W_i||²                      base   (W frozen: cache it)
         + 2s · Σ_j B_ij U_ij            cross,  U = W Aᵀ  [d_out, r]
         + s² · Σ_jk B_ij G_jk B_ik      Gram,   G = A Aᵀ  [r, r]

The factored form never builds the dense [d_out, d_in] product B·A; its
intermediates are O(d_out·r + r²), and U, G and ||W_i||² can be accumulated over
chunks of d_in to bound the transient further.
"""

from __future__ import annotations

import numpy as np

from .shapes import check_adapter, check_scaling


def dense_norm(W, A, B, scaling) -> np.ndarray:
    """Row norm of ``W + s·B·A`` built densely (the baseline every library uses).

    W [d_out, d_in], A [r, d_in], B [d_out, r]; returns float64 [d_out].
    """
    check_adapter(W, A, B)
    s = check_scaling(scaling)
    W, A, B = (np.asarray(t, np.float64) for t in (W, A, B))
    return np.linalg.norm(W + s * (B @ A), axis=1)


def base_sq_norm(W, *, chunk=None) -> np.ndarray:
    """``||W_i||²`` per row, float64 [d_out]; the part of the norm a frozen W fixes."""
    W = np.asarray(W, np.float64)
    if W.ndim != 2:
        raise ValueError(f"W must be 2-D [d_out, d_in]; got shape {W.shape}")
    return sum(np.sum(W[:, c] ** 2, axis=1) for c in _chunks(W.shape[1], chunk))


def factored_norm(W, A, B, scaling, *, chunk=None, base_sq=None) -> np.ndarray:
    """Row norm of ``W + s·B·A`` from the expansion above, without forming B·A.

    Args:
      W: [d_out, d_in]. A: [r, d_in]. B: [d_out, r]. scaling: s.
      chunk: if given, accumulate U, G and ||W||² over slices of d_in of this width.
      base_sq: optional precomputed ``||W_i||²`` [d_out] (W is frozen, so callers cache it).

    Returns float64 [d_out]. The squared norm is clamped at 0 before the square root:
    rounding can push an (almost) zero row's sum slightly negative.
    """
    d_out, d_in, r = check_adapter(W, A, B)
    s = check_scaling(scaling)
    if chunk is not None and int(chunk) < 1:
        raise ValueError(f"chunk must be a positive integer; got {chunk!r}")
    W, A, B = (np.asarray(t, np.float64) for t in (W, A, B))
    U = np.zeros((d_out, r))
    G = np.zeros((r, r))
    for c in _chunks(d_in, chunk):
        U += W[:, c] @ A[:, c].T
        G += A[:, c] @ A[:, c].T
    if base_sq is None:
        base_sq = base_sq_norm(W, chunk=chunk)
    else:
        base_sq = np.asarray(base_sq, np.float64)
        if base_sq.shape != (d_out,):
            raise ValueError(f"base_sq must have shape ({d_out},); got {base_sq.shape}")
    cross = 2.0 * s * np.sum(B * U, axis=1)
    gram = s * s * np.sum((B @ G) * B, axis=1)
    return np.sqrt(np.maximum(base_sq + cross + gram, 0.0))


def _chunks(n: int, chunk):
    step = n if chunk is None else int(chunk)
    return [slice(i, min(i + step, n)) for i in range(0, max(n, 1), max(step, 1))]
