"""dora_jax compiled for the GPU (not interpreted): the XLA path on shapes chosen to be awkward
(odd sizes, rank 1 and 384, TF32 in f32 dots) and the Mosaic GPU compose on Hopper, against
the spec. Run on the GPU machine: ``python -m pytest -q -m gpu tests/jax``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from shared_spec.cases import CASES, Case

from .spec_check import check_case
from .test_dtypes import BF16X3_NORM_CASES, BF16X3_NORM_IDS, check_bf16x3_norm

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
def test_xla_against_spec(case, dtype):
    check_case(case, dtype, impl="xla")


@pytest.mark.parametrize("case", GPU_CASES[:2], ids=[c.name for c in GPU_CASES[:2]])
def test_xla_exact_norm_grad(case):
    check_case(case, jnp.float32, impl="xla", exact_norm_grad=True)


@pytest.mark.parametrize("r", [8, 384])
@pytest.mark.parametrize(
    ("kernel_dtype", "b_dtype", "blocks"), BF16X3_NORM_CASES, ids=BF16X3_NORM_IDS
)
def test_norm_gram_term_as_bf16x3(kernel_dtype, b_dtype, blocks, r):
    """Compiled for the GPU, the bf16x3 G·b keeps its lo parts (XLA's excess-precision
    rewrites must not fold the split away): within the bf16x3 bound of float64."""
    check_bf16x3_norm(kernel_dtype, b_dtype, blocks, d_in=512, d_out=640, r=r)


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
    """The compiled Mosaic compose and scale-and-reduce inside dora_dense (r = 1 and 384, zero
    rows, bf16 and f16): forward and every gradient against the spec."""
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


def _pass_config(op: str, tiles: tuple):
    """MosaicConfig with the cotangent pass ``op``'s (tile_m, tile_n[, chunk_m]) set."""
    from dora_jax.config import MosaicConfig

    names = ("tile_m", "tile_n", "chunk_m")
    return MosaicConfig(**{f"{op}_{k}": v for k, v in zip(names, tiles, strict=False)})


@pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels need Hopper (sm90)")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(
    ("tokens", "d_out", "tiles"),
    [(64, 32, (256, 32)), (192, 96, (256, 32)), (1024, 512, (128, 64)), (2048, 4096, (256, 32)),
     (4096, 14336, (256, 32)), (320, 128, (64, 128)),
     # the arithmetic in 64-row slabs of the tile (MosaicConfig.swiglu_chunk_m)
     (2048, 14336, (256, 32, 64)), (192, 96, (256, 32, 64))],
)  # fmt: skip
def test_mosaic_swiglu_backward_matches_float64(tokens, d_out, tiles, dtype):
    from dora_jax import mosaic
    from shared_spec.tolerances import assert_close

    from .test_swiglu import float64_pass, kernel_operands, xla_pass

    config = _pass_config("swiglu", tiles)
    ops = kernel_operands(tokens, d_out, dtype, seed=tokens + d_out)
    got = jax.jit(functools.partial(mosaic.swiglu_backward, config=config))(*ops)
    ref, base = float64_pass(*ops, dtype), xla_pass(*ops)
    eps = float(jnp.finfo(dtype).eps)
    for name, a, r, b in zip(("dy_g gate", "dy_g up", "col gate", "col up"), got, ref, base):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert_close(a, r, b, machine_eps=eps, name=name)


@pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels need Hopper (sm90)")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(
    ("tokens", "d_out", "tiles"),
    [(64, 32, (256, 32)), (192, 96, (256, 32)), (2048, 1024, (256, 32)), (2048, 4096, (128, 64)),
     (8192, 4096, (256, 32)), (2048, 14336, (64, 128)),
     # the arithmetic in slabs (MosaicConfig.scale_reduce_chunk_m)
     (2048, 14336, (256, 128, 64)), (192, 96, (256, 32, 128))],
)  # fmt: skip
def test_mosaic_scale_reduce_matches_the_xla_pass(tokens, d_out, tiles, dtype):
    from dora_jax import mosaic

    from .test_mosaic import check_scale_reduce

    config = _pass_config("scale_reduce", tiles)
    fn = jax.jit(functools.partial(mosaic.scale_reduce, config=config))
    check_scale_reduce(fn, tokens, d_out, dtype)


@pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels need Hopper (sm90)")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_xla_compose_with_the_mosaic_scale_reduce_matches_the_spec(monkeypatch, dtype):
    from .test_mosaic import test_xla_compose_with_the_mosaic_scale_reduce_matches_the_spec as t

    t(monkeypatch, dtype)


@pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels need Hopper (sm90)")
@pytest.mark.parametrize(("d_in", "d_out", "r", "tokens"), [(256, 512, 16, 256), (128, 96, 1, 64)])
def test_mosaic_swiglu_pair_matches_the_spec(d_in, d_out, r, tokens):
    from .test_swiglu import check_fused_pair

    check_fused_pair(d_in, d_out, r, tokens)


@pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels need Hopper (sm90)")
def test_mosaic_swiglu_backward_saturates_zero_norm_columns():
    from dora_jax import mosaic

    from .test_swiglu import check_saturation

    check_saturation(jax.jit(mosaic.swiglu_backward), tokens=512, d_out=256)


@pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels need Hopper (sm90)")
@pytest.mark.parametrize("tokens", [0, 1, 100])
def test_swiglu_falls_back_where_the_kernel_cannot_tile(tokens):
    from .test_swiglu import check_fallback

    check_fallback("auto", tokens)


@pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels need Hopper (sm90)")
def test_auto_fuses_the_llama_twins_mlp_pair_on_hopper():
    from .test_swiglu import twin_fuses

    assert twin_fuses("auto")


def test_scalora_merge_rewrites_the_kernel_in_place():
    """The blocked merge (``scalora.merge_scaled``) on a donated bf16 kernel compiles to an
    in-place update: its temporaries hold one f32 block of rows, not a copy of the kernel
    (XLA's CPU backend does copy it; the GPU backend writes a dynamic-update-slice in place
    when the slice it reads has the same indices)."""
    import optax

    from dora_jax import config
    from dora_jax.scalora import scalora_update_jit

    d_in, d_out, r, bf = 8192, 8192, 64, jnp.bfloat16
    spec = jax.ShapeDtypeStruct
    adapters = {"l": {"lora_a": spec((d_in, r), bf), "lora_b": spec((r, d_out), bf)}}
    base = {"l": spec((d_in, d_out), bf)}
    state = jax.eval_shape(optax.adamw(1e-3).init, adapters)
    compiled = scalora_update_jit.lower(
        adapters, base, state, adapters, lr_times_L=1.0, scaling=2.0
    ).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    block = config.SCALORA_MERGE_ROWS * d_out * 4
    assert temp < block + d_in * d_out * 2 // 2, (temp, block)


def _kernel_concatenations(fn, x, kernels, adapters):
    """Concatenations in the GPU program of fn's training step (value and adapter gradient
    of a loss that needs every x·K) whose result has a kernel's d_in rows and at least its
    d_out columns: frozen kernels copied every call (XLA's dot merger)."""

    def loss(adapters, x, kernels):
        ys = [fn(x, k, a, b).astype(jnp.float32) for k, (a, b) in zip(kernels, adapters)]
        return sum(jnp.sum(y * y) for y in ys)

    step = jax.jit(jax.value_and_grad(loss))
    text = step.lower(adapters, x, kernels).compile().as_text()
    d_in, d_out = kernels[0].shape[0], min(k.shape[1] for k in kernels)
    shape = re.compile(rf"= bf16\[{d_in},(\d+)\]\S* concatenate\(")
    return [int(m.group(1)) for m in shape.finditer(text) if int(m.group(1)) >= d_out]


@pytest.mark.parametrize(
    ("d_outs", "r"), [((4096,), 384), ((4096, 1024, 1024), 16)], ids=["o_proj", "q_k_v"]
)
def test_the_base_product_never_concatenates_the_kernel(d_outs, r):
    """XLA's GPU dot merger joins products that share an operand (x·K and x·a; the q/k/v
    projections' x·K) into one GEMM over a concatenated copy of the kernels, every call
    (benchmarks/NOTES.md, session 24). jnp LoRA on the same Llama-8B shapes shows the merger
    is active on this XLA; DoRA's base product (behind ``vjp._base_product``'s barrier) must
    never be concatenated."""
    from dora_jax.baselines import lora_dense
    from dora_jax.functional import dora_dense

    t, d_in, bf = 2048, 4096, jnp.bfloat16
    keys = iter(jax.random.split(jax.random.key(0), 1 + 3 * len(d_outs)))
    x = jax.random.normal(next(keys), (t, d_in), bf)
    kernels, adapters = [], []
    for d_out in d_outs:
        kernels.append(jax.random.normal(next(keys), (d_in, d_out), bf) * 0.02)
        a = jax.random.normal(next(keys), (d_in, r), bf) * 0.02
        adapters.append((a, jax.random.normal(next(keys), (r, d_out), bf) * 0.02))

    def ours(x, k, a, b):
        return dora_dense(x, k, a, b, jnp.ones((k.shape[1],), jnp.float32), 2.0, impl="xla")

    def lora(x, k, a, b):
        return lora_dense(x, k, a, b, 2.0)

    assert _kernel_concatenations(lora, x, kernels, adapters), "no dot merger on this XLA"
    assert _kernel_concatenations(ours, x, kernels, adapters) == []
