"""Merging the adapter into the frozen weight and undoing it (the one place with this math).

    merged = g ⊙_rows (W + s·B·A),   W = merged / g − s·B·A,   g = m / max(n, eps)

n is the norm of the UNMERGED weight; it cannot be read back from the merged one, so
``unmerge_weight`` takes the n cached at merge time. Rows are processed in chunks so the
transient (in the compute dtype: fp32, or float64 for float64) is at most
``config.NORM_CHUNK`` rows of W.
"""

from __future__ import annotations

import torch

from . import config
from .compose import magnitude_scale
from .matmul import compute_dtype
from .norm import chunk_slices


@torch.no_grad()
def _rowwise(weight, lora_A, lora_B, fn) -> torch.Tensor:
    out = torch.empty_like(weight)
    acc = compute_dtype(weight.dtype)
    a = lora_A.to(acc)
    for rows in chunk_slices(weight.shape[0], config.NORM_CHUNK):
        out[rows] = fn(rows, weight[rows].to(acc), lora_B[rows].to(acc) @ a).to(weight.dtype)
    return out


def merge_weight(weight, lora_A, lora_B, magnitude, scaling: float, norm) -> torch.Tensor:
    """g ⊙_rows (W + s·B·A) in weight's dtype. weight [d_out, d_in], lora_A [r, d_in],
    lora_B [d_out, r], magnitude / norm [d_out] (norm of the unmerged W + s·B·A)."""
    g = magnitude_scale(magnitude.detach(), norm.detach())
    return _rowwise(weight, lora_A, lora_B, lambda rows, w, ba: g[rows, None] * (w + scaling * ba))


def unmerge_weight(merged, lora_A, lora_B, magnitude, scaling: float, norm) -> torch.Tensor:
    """Inverse of ``merge_weight``; raises ValueError for rows with m = 0 (not invertible)."""
    g = magnitude_scale(magnitude.detach(), norm.detach())
    zero = g == 0
    if bool(zero.any()):
        rows = torch.nonzero(zero).flatten()[:8].tolist()
        raise ValueError(f"cannot unmerge rows with zero magnitude (m == 0), e.g. rows {rows}")
    return _rowwise(merged, lora_A, lora_B, lambda rows, w, ba: w / g[rows, None] - scaling * ba)
