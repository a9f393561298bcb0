"""Every shared case, f32 and bf16, every impl: output and gradients against shared_spec."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from shared_spec.cases import CASES

from .spec_check import check_case

# Pallas interpret mode is slow: the "large" case runs once per dtype on XLA only.
PARAMS = [
    pytest.param(name, impl, id=f"{name}-{impl}")
    for name, case in CASES.items()
    for impl in ("xla", "pallas")
    if not ("large" in case.tags and impl == "pallas")
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("name", "impl"), PARAMS)
def test_detached_norm(name, impl, dtype):
    check_case(CASES[name], dtype, impl=impl)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("name", ["basic", "odd_shapes", "zero_base_row", "rank_exceeds_d_in"])
def test_exact_norm_grad(name, impl):
    check_case(CASES[name], jnp.float32, impl=impl, exact_norm_grad=True)


def test_large_case_pallas_f32():
    check_case(CASES["multi_block"], jnp.float32, impl="pallas")
