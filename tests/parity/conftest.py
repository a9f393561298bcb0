"""Parity tests compare fp32 results at a few ulps: keep JAX's fp32 matmuls in full fp32.

On GPUs JAX's default fp32 dot precision is TF32 (10-bit mantissa), which would make the
Flax twin differ from PyTorch's fp32 CPU results by ~1e-3. Scoped to this package's tests.
"""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(autouse=True)
def _highest_matmul_precision():
    with jax.default_matmul_precision("highest"):
        yield
