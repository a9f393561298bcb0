"""bench_model_jax's A/B switch of the bf16x3 Gram product: set for one provider, restored."""

from __future__ import annotations

import pytest

from benchmarks import bench_model_jax as bm
from dora_jax import config


def test_norm_gemm_switch_is_restored_after_an_error():
    assert config.NORM_GEMM_BF16X3 is True
    with pytest.raises(RuntimeError, match="provider failed"):
        with bm.norm_gemm_bf16x3(False):
            assert config.NORM_GEMM_BF16X3 is False
            raise RuntimeError("provider failed")
    assert config.NORM_GEMM_BF16X3 is True
