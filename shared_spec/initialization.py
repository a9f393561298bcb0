"""Adapter scale and magnitude initialisation (PEFT's conventions)."""

from __future__ import annotations

import math

from .norm import dense_norm


def scaling_for(r: int, alpha: float, use_rslora: bool = False) -> float:
    """The adapter scale s: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    if int(r) != r or r < 1:
        raise ValueError(f"r must be a positive integer; got {r!r}")
    return float(alpha) / (math.sqrt(r) if use_rslora else r)


def magnitude_init(W, A, B, scaling):
    """Initial magnitude m = ||W + s·B·A||_row, float64 [d_out].

    With it a fresh adapter reproduces the base layer exactly (g = m / n = 1).
    """
    return dense_norm(W, A, B, scaling)
