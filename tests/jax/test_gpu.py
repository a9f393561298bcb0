"""Pallas kernels compiled for the GPU (not interpreted) against the spec and the XLA path.

This is where the traps the interpreter hides show (docs/design.md §7): unmasked edge blocks, ranks
below 16 in ``plt.dot``, TF32 in f32 dots. Shapes are deliberately not block multiples.
Run on the GPU machine: ``python -m pytest -q -m gpu tests/jax``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax import kernels, xla_ops
from dora_jax.config import dot_precision
from shared_spec.cases import CASES, Case

from .spec_check import check_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a JAX GPU backend"),
]

GPU_CASES = [
    Case("gpu_odd_small_rank", d_in=300, d_out=333, r=5, lead=(257,)),
    Case("gpu_rank_384", d_in=512, d_out=640, r=384, lead=(200,)),
    Case("gpu_3d_rank_24", d_in=1000, d_out=1030, r=24, lead=(3, 77)),
    Case("gpu_rank_one_wide", d_in=96, d_out=4100, r=1, lead=(33,), bias=False),
]
ALL = list(CASES.values()) + GPU_CASES


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", ALL, ids=[c.name for c in ALL])
def test_pallas_against_spec(case, dtype):
    check_case(case, dtype, impl="pallas")


@pytest.mark.parametrize("case", GPU_CASES[:2], ids=[c.name for c in GPU_CASES[:2]])
def test_pallas_exact_norm_grad(case):
    check_case(case, jnp.float32, impl="pallas", exact_norm_grad=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("tokens", "d_out", "rank"), [(257, 333, 5), (64, 128, 16), (1, 4100, 384)]
)
def test_kernels_match_xla_ops(tokens, d_out, rank, dtype):
    keys = jax.random.split(jax.random.key(0), 6)
    base = jax.random.normal(keys[0], (tokens, d_out), dtype)
    h = jax.random.normal(keys[1], (tokens, rank), dtype)
    b = (jax.random.normal(keys[2], (rank, d_out)) / rank).astype(dtype)
    g = 1 + 0.1 * jax.random.normal(keys[3], (d_out,))
    bias = jax.random.normal(keys[4], (d_out,))
    prec = dot_precision(dtype)
    y = kernels.compose(base, h, b, g, bias, scaling=2.0, precision=prec)
    y_ref, _ = xla_ops.compose(
        base, h, b, g, bias, scaling=2.0, precision=jax.lax.Precision.HIGHEST
    )
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=tol, atol=tol
    )

    dy = jax.random.normal(keys[5], (tokens, d_out), dtype)
    dy_g, col = kernels.scale_reduce(dy, base, g)
    dy_g_ref, col_ref = xla_ops.scale_reduce(dy, base, g)
    np.testing.assert_array_equal(np.asarray(dy_g, np.float32), np.asarray(dy_g_ref, np.float32))
    np.testing.assert_allclose(col, col_ref, rtol=1e-4, atol=1e-3)

    u = jax.random.normal(keys[0], (rank, d_out))
    a = jax.random.normal(keys[1], (rank + 3, rank))
    gram = a.T @ a
    base_sq = 10.0 + jnp.abs(jax.random.normal(keys[2], (d_out,))) * rank
    n = kernels.norm_assembly(u, gram, b, base_sq, scaling=0.5, precision=prec)
    n_ref = xla_ops.norm_assembly(
        u, gram, b, base_sq, scaling=0.5, precision=jax.lax.Precision.HIGHEST
    )
    np.testing.assert_allclose(n, n_ref, rtol=1e-4 if dtype == jnp.float32 else 2e-3)


# ---------------------------------------------------------------------- Mosaic GPU (Hopper)
def _hopper() -> bool:
    return all(str(getattr(d, "compute_capability", "")).startswith("9.") for d in jax.devices())


MOSAIC_GPU_CASES = [
    Case("gpu_mosaic_rank_16", d_in=512, d_out=1024, r=16, lead=(256,)),
    Case("gpu_mosaic_rank_384", d_in=256, d_out=512, r=384, lead=(2, 128)),
    Case("gpu_mosaic_rank_one", d_in=96, d_out=384, r=1, lead=(64,), bias=False),
    Case("gpu_mosaic_zero_rows", d_in=64, d_out=256, r=8, lead=(128,), zero_rows=(0, 130)),
]


@pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels need Hopper (sm90)")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", MOSAIC_GPU_CASES, ids=[c.name for c in MOSAIC_GPU_CASES])
def test_mosaic_against_spec(case, dtype):
    """The compiled Mosaic compose inside dora_dense: forward and every gradient."""
    if case.zero_rows and dtype == jnp.float16:
        pytest.skip("the naive f16 baseline overflows on zero columns (test_mosaic.py checks it)")
    check_case(case, dtype, impl="mosaic")


@pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels need Hopper (sm90)")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("in_flight", [0, 1], ids=["wait", "one_in_flight"])
@pytest.mark.parametrize(
    ("tokens", "d_out", "rank"), [(64, 128, 1), (256, 512, 40), (4096, 4096, 384)]
)
def test_mosaic_compose_matches_float64(tokens, d_out, rank, dtype, in_flight):
    from dora_jax import mosaic
    from dora_jax.config import MosaicConfig

    from .compose_check import check_compose

    config = MosaicConfig(compose_max_concurrent_steps=3, compose_wgmma_in_flight=in_flight)
    compose = jax.jit(functools.partial(mosaic.compose, config=config), static_argnames="scaling")
    check_compose(compose, tokens, d_out, rank, dtype)
