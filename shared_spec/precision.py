"""Low-precision emulation in NumPy, for demonstrating rounding effects in the spec.

NumPy has no bfloat16; ``round_to_bfloat16`` rounds float values to the nearest
bfloat16 (round-half-to-even on the float32 bit pattern) and returns float64, so
an algorithm can be replayed with a rounding after every operation.
"""

from __future__ import annotations

import numpy as np

BF16_EPS = 2.0**-7  # spacing of bfloat16 numbers just above 1.0


def round_to_bfloat16(x) -> np.ndarray:
    """Round to the nearest bfloat16 value; returns float64 of the same shape."""
    f = np.asarray(x, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    # Round half to even on the 16 bits that bfloat16 drops.
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32)
    out = np.where(np.isnan(f), f, out)  # keep NaN a NaN (rounding could make it inf)
    return out.astype(np.float64)
