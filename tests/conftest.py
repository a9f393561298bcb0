"""Test-wide setup.

Without a CUDA GPU, Triton kernels run in its interpreter. TRITON_INTERPRET
must be set before any ``@triton.jit`` decorator runs (docs/design.md §7), so it is set
here, before the test modules import the package.
"""

from __future__ import annotations

import contextlib
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


@pytest.fixture
def x64():
    """jax_enable_x64 for the duration of one test; the previous setting is restored."""
    import jax

    before = jax.config.jax_enable_x64
    if before:
        context = contextlib.nullcontext()
    elif hasattr(jax, "enable_x64"):  # jax >= 0.10: a config context manager
        context = jax.enable_x64(True)
    else:
        context = jax.experimental.enable_x64()  # older jax
    with context:
        assert jax.config.jax_enable_x64
        yield
    assert jax.config.jax_enable_x64 == before
