"""dora_jax.mosaic on the CPU: Pallas' GPU interpreter runs the kernel against float64, and each
kernel configuration is lowered for CUDA (layout, tiling and swizzle errors surface at
lowering, without a GPU). Compiled runs on the H200 are in ``test_gpu.py`` (the gate for what
the interpreter cannot show: timing of TMA and wgmma, real layouts)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from dora_jax import mosaic
from dora_jax.config import AUTO_MOSAIC, MosaicConfig, resolve_impl
from dora_jax.functional import dora_dense, resolved_impls

from .compose_check import MOSAIC_CASES, check_compose, compose_operands
from .spec_check import check_case

DTYPES = [jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize(
    ("tokens", "d_out", "rank", "bias"),
    [(64, 128, 1, True), (64, 128, 16, False), (128, 256, 40, True), (64, 128, 96, True)],
)
def test_compose_matches_float64_within_the_xla_error(tokens, d_out, rank, bias, dtype):
    compose = functools.partial(mosaic.compose, interpret=True)
    check_compose(compose, tokens, d_out, rank, dtype, bias=bias)


def test_compose_with_a_wgmma_left_in_flight_matches_float64():
    config = MosaicConfig(compose_max_concurrent_steps=3, compose_wgmma_in_flight=1)
    compose = functools.partial(mosaic.compose, interpret=True, config=config)
    check_compose(compose, 128, 256, 200, jnp.bfloat16)  # 4 rank steps of 64


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("config", "rank"),
    [
        (MosaicConfig(), 8),
        (MosaicConfig(), 384),
        (MosaicConfig(compose_tile_m=128), 32),
        (MosaicConfig(compose_max_concurrent_steps=3, compose_wgmma_in_flight=1), 384),
    ],
)
def test_compose_lowers_for_cuda(config, rank, bias, dtype):
    base, h, b, g, bias_v = compose_operands(256, 512, rank, dtype, bias=bias)
    fn = jax.jit(functools.partial(mosaic.compose, scaling=2.0, config=config))
    lowered = fn.trace(base, h, b, g, bias_v).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_compose_refuses_what_it_cannot_tile():
    base, h, b, g, _ = compose_operands(64, 128, 8, jnp.bfloat16)
    assert mosaic.compose_supported(64, 128, jnp.bfloat16)
    for tokens, d_out, dtype in [(63, 128, "bfloat16"), (64, 130, "float16"), (0, 128, "bfloat16"),
                                 (64, 128, "float32")]:  # fmt: skip
        assert not mosaic.compose_supported(tokens, d_out, dtype)
    with pytest.raises(ValueError, match="T % 64 == 0"):
        mosaic.compose(base[:63], h[:63], b, g, scaling=1.0, interpret=True)
    with pytest.raises(ValueError, match="must match"):
        mosaic.compose(base, h.astype(jnp.float16), b, g, scaling=1.0, interpret=True)


def test_mosaic_config_is_checked():
    with pytest.raises(ValueError, match="compose_tile_n"):
        MosaicConfig(compose_tile_n=96)
    with pytest.raises(ValueError, match="compose_tile_m"):
        MosaicConfig(compose_tile_m=32)
    with pytest.raises(ValueError, match="compose_max_concurrent_steps"):
        MosaicConfig(compose_max_concurrent_steps=0)
    with pytest.raises(ValueError, match="compose_wgmma_in_flight"):
        MosaicConfig(compose_wgmma_in_flight=2)
    with pytest.raises(ValueError, match="needs compose_max_concurrent_steps > 1"):
        MosaicConfig(compose_wgmma_in_flight=1, compose_max_concurrent_steps=1)
    with pytest.raises(TypeError):
        MosaicConfig(64)  # keyword-only


def test_impl_mosaic_resolves_per_op_and_falls_back_to_xla():
    shape = (128, 48, 256, 8)
    got = {op: resolve_impl("mosaic", op, platform="gpu", shape=shape, dtype=jnp.bfloat16)
           for op in ("norm", "compose", "scale_reduce")}  # fmt: skip
    assert got == {"norm": "xla", "compose": "mosaic", "scale_reduce": "mosaic"}
    odd = (100, 48, 256, 8)
    assert resolve_impl("mosaic", "compose", platform="gpu", shape=odd, dtype="bfloat16") == "xla"
    assert resolve_impl("mosaic", "compose", platform="gpu", shape=shape, dtype="float32") == "xla"
    assert resolved_impls((2, 64, 48), (48, 256), 8, impl="mosaic")["compose"] == "mosaic"
    # "auto" picks Mosaic only where AUTO_MOSAIC has a measured rule, and never off the GPU
    assert resolve_impl("auto", "compose", platform="cpu", shape=shape, dtype="bfloat16") == "xla"
    on_gpu = resolve_impl("auto", "compose", platform="gpu", shape=shape, dtype="bfloat16")
    if AUTO_MOSAIC["compose"] is None:
        assert on_gpu == "xla"


def test_auto_picks_mosaic_only_on_hopper_where_a_rule_says_so(monkeypatch):
    from dora_jax import config

    shape = (128, 48, 256, 8)
    monkeypatch.setattr(config, "AUTO_MOSAIC", {"compose": lambda t, i, o, r: t >= 128})

    def auto(shape, dtype="bfloat16"):
        return resolve_impl("auto", "compose", platform="gpu", shape=shape, dtype=dtype)

    monkeypatch.setattr(config, "_one_hopper", lambda: True)
    assert auto(shape) == "mosaic"
    assert auto((64, 48, 256, 8)) != "mosaic"  # the rule says no
    assert auto((100, 48, 256, 8)) != "mosaic"  # the kernel cannot tile it
    assert auto(shape, "float32") != "mosaic"
    monkeypatch.setattr(config, "_one_hopper", lambda: False)
    assert auto(shape) != "mosaic"
    monkeypatch.undo()
    if jax.default_backend() != "gpu":
        assert config._one_hopper() is False  # no GPU backend: no error, no Mosaic


# f16 with a zero-norm column overflows the naive baseline (m/eps), which leaves the tolerance
# rule without a bound: that pair is checked against the spec in test_dtypes.py.
SPEC_PAIRS = [(c, dt) for c in MOSAIC_CASES for dt in DTYPES
              if not (c.zero_rows and dt == jnp.float16)]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "dtype"), SPEC_PAIRS, ids=[f"{c.name}-{jnp.dtype(d).name}" for c, d in SPEC_PAIRS]
)
def test_dora_dense_with_the_mosaic_compose_matches_the_spec(case, dtype):
    """Forward and every gradient (the backward of the fused compose: base is saved, inner
    never formed) under the shared tolerance rule, the kernel interpreted on the CPU."""
    check_case(case, dtype, impl="mosaic")


def test_dora_dense_runs_the_kernel_only_where_it_was_chosen():
    k = jnp.ones((48, 128), jnp.bfloat16)
    a, b, m = jnp.ones((48, 8)), jnp.ones((8, 128)), jnp.ones(128)

    def program(impl, tokens, dropout=0.0):
        x = jnp.ones((tokens, 48), jnp.bfloat16)
        return str(jax.make_jaxpr(lambda x: dora_dense(
            x, k, a, b, m, 2.0, impl=impl, dropout_rate=dropout, dropout_rng=jax.random.key(0),
            deterministic=dropout == 0.0))(x))  # fmt: skip

    assert "wgmma" in program("mosaic", 64)
    assert "wgmma" not in program("xla", 64)
    assert "wgmma" not in program("mosaic", 65)  # not a tile multiple: XLA
    assert "wgmma" not in program("mosaic", 64, dropout=0.1)  # no dropout form: XLA


def test_no_tokens_take_the_xla_path():
    x = jnp.zeros((0, 48), jnp.bfloat16)
    k = jnp.ones((48, 128), jnp.bfloat16)
    a, b = jnp.ones((48, 8), jnp.float32), jnp.ones((8, 128), jnp.float32)
    y = dora_dense(x, k, a, b, jnp.ones(128), 2.0, impl="mosaic")
    assert y.shape == (0, 128) and y.dtype == jnp.bfloat16


def reduce_operands(tokens, d_out, dtype, seed=0):
    """(dy, saved, g) for the scale-and-reduce pass; g is zero at column 3 (m = 0)."""
    k = jax.random.split(jax.random.key(seed), 3)
    dy = jax.random.normal(k[0], (tokens, d_out)).astype(dtype)
    saved = (2 * jax.random.normal(k[1], (tokens, d_out))).astype(dtype)
    g = (1 + 0.1 * jax.random.normal(k[2], (d_out,))).at[3].set(0.0)
    return dy, saved, g


def check_scale_reduce(scale_reduce, tokens, d_out, dtype):
    """``scale_reduce`` (the kernel, interpreted or compiled) against ``xla_ops.scale_reduce``
    and float64: g ⊙ dy bit-identical (the same f32 product and one rounding), the column
    sums within the XLA pass's error of float64 (shared tolerance rule)."""
    import numpy as np

    from dora_jax import xla_ops
    from shared_spec.tolerances import assert_close

    dy, saved, g = reduce_operands(tokens, d_out, dtype)
    dy_g, col = scale_reduce(dy, saved, g)
    ref_g, ref_col = jax.jit(xla_ops.scale_reduce)(dy, saved, g)
    assert dy_g.dtype == dtype and col.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(dy_g, np.float32), np.asarray(ref_g, np.float32))
    f = functools.partial(np.asarray, dtype=np.float64)
    exact = (f(dy.astype(jnp.float32)) * f(saved.astype(jnp.float32))).sum(0)
    assert_close(col, exact, ref_col, machine_eps=float(jnp.finfo(jnp.float32).eps), name="col")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize(
    ("tokens", "d_out", "config"),
    [
        (64, 32, MosaicConfig(scale_reduce_tile_n=32)),
        (192, 96, MosaicConfig(scale_reduce_tile_m=256, scale_reduce_tile_n=32)),
        (128, 256, MosaicConfig()),
        # the arithmetic in 64-row slabs of a 256-row tile; and a 128-row slab where 192
        # tokens need 64-row tiles (the slab shrinks with the tile)
        (256, 128, MosaicConfig(scale_reduce_tile_m=256, scale_reduce_chunk_m=64)),
        (
            192,
            96,
            MosaicConfig(scale_reduce_tile_m=256, scale_reduce_tile_n=32, scale_reduce_chunk_m=128),
        ),
    ],
)
def test_scale_reduce_matches_the_xla_pass(tokens, d_out, config, dtype):
    fn = functools.partial(mosaic.scale_reduce, config=config, interpret=True)
    check_scale_reduce(fn, tokens, d_out, dtype)


def test_scale_reduce_saturates_instead_of_overflowing():
    dy, saved, g = reduce_operands(64, 128, jnp.float16)
    saved, g = saved.at[:, 5].set(0), g.at[5].set(1e30)  # a zero-norm column: g = m / eps
    dy_g, col = mosaic.scale_reduce(dy, saved, g, interpret=True)
    assert bool(jnp.all(jnp.isfinite(dy_g))) and bool(jnp.all(jnp.isfinite(col)))
    assert float(jnp.max(jnp.abs(dy_g[:, 5]))) == float(jnp.finfo(jnp.float16).max)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize(
    "config",
    [
        MosaicConfig(),
        MosaicConfig(scale_reduce_tile_m=256, scale_reduce_tile_n=32),
        MosaicConfig(scale_reduce_tile_m=256, scale_reduce_chunk_m=64),
    ],
)
def test_scale_reduce_lowers_for_cuda(config, dtype):
    dy, saved, g = reduce_operands(512, 256, dtype)
    fn = jax.jit(functools.partial(mosaic.scale_reduce, config=config))
    assert "mosaic_gpu" in fn.trace(dy, saved, g).lower(lowering_platforms=("cuda",)).as_text()


def test_scale_reduce_refuses_what_it_cannot_tile():
    assert mosaic.scale_reduce_supported(192, 128, jnp.bfloat16)  # 192 rows: tiles of 64
    for tokens, d_out, dtype in [(100, 128, "bfloat16"), (64, 96, "bfloat16"),
                                 (0, 128, "bfloat16"), (64, 128, "float32")]:  # fmt: skip
        assert not mosaic.scale_reduce_supported(tokens, d_out, dtype)
    dy, saved, g = reduce_operands(64, 128, jnp.bfloat16)
    with pytest.raises(ValueError, match="T % 64 == 0"):
        mosaic.scale_reduce(dy[:60], saved[:60], g)
    with pytest.raises(ValueError, match="must match"):
        mosaic.scale_reduce(dy, saved.astype(jnp.float16), g)
    with pytest.raises(ValueError, match="one shape"):
        mosaic.scale_reduce(dy, saved[:, :64], g)
    with pytest.raises(ValueError, match=r"g must have shape \(128,\)"):
        mosaic.scale_reduce(dy, saved, g[:64])
    with pytest.raises(ValueError, match="2-D"):
        mosaic.scale_reduce(dy[None], saved[None], g)
    with pytest.raises(ValueError, match="scale_reduce_tile_m"):
        MosaicConfig(scale_reduce_tile_m=96)
    with pytest.raises(ValueError, match="scale_reduce_tile_n"):
        MosaicConfig(scale_reduce_tile_n=256)
    for chunk in (32, 96, True, 64.0):
        with pytest.raises(ValueError, match="scale_reduce_chunk_m must be None or a power"):
            MosaicConfig(scale_reduce_tile_m=256, scale_reduce_chunk_m=chunk)
    with pytest.raises(ValueError, match="swiglu_chunk_m=512 must not exceed swiglu_tile_m=256"):
        MosaicConfig(swiglu_chunk_m=512)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_xla_compose_with_the_mosaic_scale_reduce_matches_the_spec(monkeypatch, dtype):
    """The pairing ``impl="auto"`` makes on Hopper (XLA compose, saved inner; the Mosaic
    scale-and-reduce in the backward): forward and every gradient against the spec, the
    kernel interpreted. A mutated kernel (column sums 5% off, or g ⊙ dy 2% off) fails it."""
    from dora_jax import functional

    real = functional.resolve_impl

    def only_the_reduce(impl, op, **kw):
        return "mosaic" if op == "scale_reduce" and real("mosaic", op, **kw) == "mosaic" else "xla"

    monkeypatch.setattr(functional, "resolve_impl", only_the_reduce)
    check_case(MOSAIC_CASES[0], dtype, impl="auto")
    check_case(MOSAIC_CASES[1], dtype, impl="auto")
