"""``benchmarks/bench_norm_group_jax.py`` on the CPU: the grouped norms equal the layers' own
(``norm.norm_parts``) for every layer, whatever order the shape groups come in, and the tiny
run times both variants."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks import bench_norm_group_jax as ng
from benchmarks.bench_jax_parts import TINY


@pytest.mark.parametrize("rank", [1, 8])
def test_grouped_norms_are_the_layers_own(rank):
    # three layers of two shapes, interleaved, so the groups are not contiguous
    ps = ng.params(3, rank, TINY)
    ref = jax.jit(ng.per_layer)(ps)
    got = jax.jit(ng.grouped)(ps)
    assert len(got) == len(ref) == 3 * len(TINY)
    for x, y in zip(ref, got, strict=True):
        assert x.shape == y.shape
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2e-6, atol=0)
    # a control: another layer's g does not pass for this one
    assert not np.allclose(np.asarray(got[0]), np.asarray(ref[len(TINY)]), rtol=2e-6, atol=0)


def test_the_tiny_run_times_both_variants(tmp_path):
    rows = ng.main(["--tiny", "--ranks", "4", "--layers", "2", "--out", str(tmp_path)])
    assert [r["variant"] for r in rows] == list(ng.VARIANTS)
    assert all(r["ms"] > 0 and r["adapted"] == 2 * len(TINY) for r in rows)
    assert (tmp_path / "norm_group_jax.csv").exists()
    with pytest.raises(SystemExit):
        ng.main(["--tiny", "--layers", "0"])
