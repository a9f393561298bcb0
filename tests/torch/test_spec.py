"""Every tier against the float64 spec on the shared cases (forward + every gradient)."""

from __future__ import annotations

import pytest
import torch

from shared_spec import cases

from .helpers import check_tier

CASE_NAMES = [n for n, c in cases.CASES.items() if "large" not in c.tags]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("impl", ["eager", "fused"])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_tier_matches_spec(case, impl, dtype):
    check_tier(case, dtype, impl)


@pytest.mark.parametrize("impl", ["eager", "fused"])
def test_large_case(impl):
    check_tier("multi_block", torch.bfloat16, impl)
    check_tier("multi_block", torch.float32, impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
@pytest.mark.parametrize("impl", ["eager", "fused"])
@pytest.mark.parametrize("case", ["odd_shapes", "rslora", "zero_base_row", "magnitude_perturbed"])
def test_exact_norm_grad_matches_spec(case, impl, dtype):
    check_tier(case, dtype, impl, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
@pytest.mark.parametrize("impl", ["eager", "fused"])
@pytest.mark.parametrize("case", ["basic", "odd_shapes", "no_bias", "batched_3d", "near_unity_g"])
def test_dropout_matches_spec(case, impl, dtype):
    check_tier(case, dtype, impl, dropout_p=0.3)
