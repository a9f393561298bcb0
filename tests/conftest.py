"""Test-wide setup.

Without a CUDA GPU, Triton kernels run in its interpreter. TRITON_INTERPRET
must be set before any ``@triton.jit`` decorator runs (docs/design.md §7), so it is set
here, before the test modules import the package.
"""

from __future__ import annotations

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# On a GPU, JAX allocates on demand instead of taking 75% of the card before the torch tests run.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
