"""bench_jax_passes on the CPU: tiles parse, every variant of each pass computes what XLA's
does, unsupported tiles are skipped, and the tiny run times every variant."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks import bench_jax_passes as bp


def test_tiles_parse_and_bad_ones_fail():
    assert bp.parse_tile("64x128") == (64, 128, None)
    assert bp.parse_tile("256x32c64") == (256, 32, 64)
    assert bp.tile_name(256, 32, 64) == "256x32c64" and bp.tile_name(64, 128, None) == "64x128"
    with pytest.raises(ValueError, match="MxN"):
        bp.parse_tile("64-128")
    with pytest.raises(SystemExit):
        bp.main(["--tiny", "--tiles", "64by128"])


@pytest.mark.parametrize("pass_name", bp.PASSES)
def test_every_variant_computes_the_same_pass(pass_name):
    """The wiring: every tile's kernel gives the default tile's scaled cotangents bit for bit
    and its column sums to f32 rounding; the one-layer kernel also gives XLA's g ⊙ dy bit for
    bit. (Each kernel's accuracy against float64 is tests/jax's job.)"""
    args = bp.operands(256, 128)
    found = bp.variants(pass_name, [(64, 64, None), (256, 64, 64)], interpret=True)
    assert next(iter(found)) == "xla" and {"mosaic_64x64", "mosaic_256x64c64"} <= set(found)
    outs = {name: [np.asarray(o, np.float32) for o in fn(*args)] for name, (fn, _) in found.items()}
    scaled = len(outs["xla"]) // 2
    kernels = [name for name in outs if name != "xla"]
    for name in kernels[1:]:
        for i, (got, ref) in enumerate(zip(outs[name], outs[kernels[0]], strict=True)):
            if i < scaled:
                np.testing.assert_array_equal(got, ref, err_msg=name)
            else:
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4, err_msg=name)
    if pass_name == "scale_reduce":
        np.testing.assert_array_equal(outs[kernels[0]][0], outs["xla"][0])


def test_unsupported_tiles_are_skipped():
    found = bp.variants("scale_reduce", [(64, 128, None)], interpret=True)
    (_, config) = found["mosaic_64x128"]
    assert bp.supported("scale_reduce", config, 64, 128)
    assert not bp.supported("scale_reduce", config, 64, 96)
    assert bp.supported("scale_reduce", None, 3, 5)  # XLA takes every shape


def test_the_tiny_run_times_every_variant():
    rows = bp.run(tiny=True, passes=["scale_reduce"], tiles=[], calls=2, reps=1)
    assert {row["variant"] for row in rows} == {"xla", "mosaic_64x128"}
    assert all(row["us"] > 0 and row["backend"] == jax.default_backend() for row in rows)
