"""The one place layouts are converted (PyTorch ⇄ Flax).

PyTorch (canonical): W [d_out, d_in], A [r, d_in], B [d_out, r].
Flax:                kernel [d_in, d_out], lora_a [d_in, r], lora_b [r, d_out].
Magnitude and bias are [d_out] in both.
"""

from __future__ import annotations

import numpy as np

from .shapes import check_adapter


def to_flax_layout(W, A, B):
    """(W, A, B) in PyTorch layout → (kernel, lora_a, lora_b) in Flax layout."""
    check_adapter(W, A, B)
    return np.swapaxes(W, 0, 1), np.swapaxes(A, 0, 1), np.swapaxes(B, 0, 1)


def from_flax_layout(kernel, lora_a, lora_b):
    """(kernel, lora_a, lora_b) in Flax layout → (W, A, B) in PyTorch layout."""
    W, A, B = np.swapaxes(kernel, 0, 1), np.swapaxes(lora_a, 0, 1), np.swapaxes(lora_b, 0, 1)
    check_adapter(W, A, B)
    return W, A, B
