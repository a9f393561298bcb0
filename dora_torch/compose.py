"""Magnitude scale and stable composition in plain torch (the eager tier; DESIGN §3).

Eps policy (shared with the spec and every kernel): g = m / max(n, EPS), EPS = 1e-12.
"""

from __future__ import annotations

import torch

from .config import EPS


def magnitude_scale(magnitude: torch.Tensor, norm: torch.Tensor, *, eps: float = EPS):
    """g = m / max(n, eps): fp32 [d_out] from magnitude [d_out] (any float dtype) and norm
    [d_out]. Differentiable; the gradient through the clamp is zero."""
    if magnitude.shape != norm.shape:
        raise ValueError(
            f"magnitude {tuple(magnitude.shape)} and norm {tuple(norm.shape)} must have the "
            "same shape"
        )
    return magnitude.float() / norm.float().clamp_min(eps)


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
    """``g ⊙ (base + s·lora) + bias`` evaluated in fp32 and rounded once to base's dtype.

    base = x Wᵀ [..., d_out] (no bias), lora = (x Aᵀ) Bᵀ [..., d_out], magnitude / norm /
    bias [d_out]. Never forms ``g − 1`` in the activation dtype.
    """
    y = magnitude_scale(magnitude, norm, eps=eps) * (base.float() + float(scaling) * lora.float())
    if bias is not None:
        y = y + bias.float()
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
    """PEFT's dropout form ``base + (g − 1) ⊙ base_d + g·s ⊙ lora_d + bias`` (DESIGN §1), with
    base = x Wᵀ, base_d = x_d Wᵀ, lora_d = (x_d Aᵀ) Bᵀ; g − 1 = (m − n)/n formed in fp32."""
    n = norm.float().clamp_min(eps)
    m = magnitude.float()
    y = base.float() + ((m - n) / n) * base_d.float() + (m / n * float(scaling)) * lora_d.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(base.dtype)
