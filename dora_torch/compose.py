"""Magnitude scale and stable composition in plain torch (the eager tier; docs/design.md §3).

Eps policy (shared with the spec and every kernel): g = m / max(n, EPS), EPS = 1e-12. Every
function here computes in the compute dtype promote(fp32, dtype) (fp32; float64 for float64)
and rounds once at the end. ``magnitude_scale`` and ``magnitude_scale_minus_one`` are the one
place g and g − 1 are written in torch.
"""

from __future__ import annotations

import torch

from .config import EPS
from .matmul import compute_dtype


def magnitude_scale(magnitude: torch.Tensor, norm: torch.Tensor, *, eps: float = EPS):
    """g = m / max(n, eps): [d_out] in the compute dtype of n, from magnitude [d_out] (any
    float dtype) and norm [d_out]. Differentiable; the gradient through the clamp is zero."""
    _same_shape(magnitude, norm)
    acc = compute_dtype(norm.dtype)
    return magnitude.to(acc) / norm.to(acc).clamp_min(eps)


def magnitude_scale_minus_one(magnitude, norm, *, eps: float = EPS) -> torch.Tensor:
    """g − 1 = (m − n) / max(n, eps), formed without cancellation in the compute dtype."""
    _same_shape(magnitude, norm)
    acc = compute_dtype(norm.dtype)
    n = norm.to(acc).clamp_min(eps)
    return (magnitude.to(acc) - n) / n


def _same_shape(magnitude, norm) -> None:
    if magnitude.shape != norm.shape:
        raise ValueError(
            f"magnitude {tuple(magnitude.shape)} and norm {tuple(norm.shape)} must have the "
            "same shape"
        )


def compose(
    base: torch.Tensor,
    lora: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    *,
    eps: float = EPS,
) -> torch.Tensor:
    """``g ⊙ (base + s·lora) + bias`` evaluated in the compute dtype, rounded once to base's dtype.

    base = x Wᵀ [..., d_out] (no bias), lora = (x Aᵀ) Bᵀ [..., d_out], magnitude / norm /
    bias [d_out]. Never forms ``g − 1`` in the activation dtype.
    """
    acc = compute_dtype(base.dtype)
    g = magnitude_scale(magnitude, norm, eps=eps).to(acc)
    y = g * (base.to(acc) + float(scaling) * lora.to(acc))
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(base.dtype)


def compose_dropout(
    base: torch.Tensor,
    base_d: torch.Tensor,
    lora_d: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    *,
    eps: float = EPS,
) -> torch.Tensor:
    """PEFT's dropout form ``base + (g − 1) ⊙ base_d + g·s ⊙ lora_d + bias`` (docs/design.md
    §1), with base = x Wᵀ, base_d = x_d Wᵀ, lora_d = (x_d Aᵀ) Bᵀ."""
    acc = compute_dtype(base.dtype)
    g1 = magnitude_scale_minus_one(magnitude, norm, eps=eps).to(acc)
    gs = magnitude_scale(magnitude, norm, eps=eps).to(acc) * float(scaling)
    y = base.to(acc) + g1 * base_d.to(acc) + gs * lora_d.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(base.dtype)
