"""``benchmarks/ncu_mosaic_pass.py`` on the CPU: the raw kernel it hands to PyTorch is the one
the public functions run (interpreted), and wrong arguments are refused by name."""

from __future__ import annotations

import pytest

from benchmarks import ncu_mosaic_pass as probe
from dora_jax import mosaic


@pytest.mark.parametrize(
    ("op", "shape", "tile"),
    [("scale_reduce", "192x256", []), ("swiglu", "128x64", []),
     ("swiglu", "256x64", ["--tile", "256x32c64"])],
)  # fmt: skip
def test_the_raw_kernel_is_the_public_functions(op, shape, tile):
    assert probe.main(["--dry", "--op", op, "--shape", shape, *tile]) == 0
    if tile:
        assert probe.config_for(op, tile[1]).swiglu_chunk_m == 64


def test_wrong_arguments_are_named():
    with pytest.raises(ValueError, match="--shape must look like TxN"):
        probe.parse_shape("2048")
    with pytest.raises(ValueError, match="op must be one of"):
        mosaic.pass_kernel("compose", 64, 128, "bfloat16")
    with pytest.raises(SystemExit):
        probe.main(["--dry", "--op", "compose"])
