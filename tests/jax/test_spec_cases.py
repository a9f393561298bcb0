"""Every shared case, f32 and bf16: output and gradients against shared_spec (the XLA path;
the Mosaic compose is checked on the cases it tiles in test_mosaic.py)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from shared_spec.cases import CASES

from .spec_check import check_case


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_detached_norm(name, dtype):
    check_case(CASES[name], dtype, impl="xla")


@pytest.mark.parametrize("name", ["basic", "odd_shapes", "zero_base_row", "rank_exceeds_d_in"])
def test_exact_norm_grad(name):
    check_case(CASES[name], jnp.float32, impl="xla", exact_norm_grad=True)
