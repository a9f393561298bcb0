"""bench_jax_parts on the CPU: the sliced Gram equals aᵀa, the loop timer runs, layer sums add."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench_jax_parts as bp


@pytest.mark.parametrize(("d_in", "slices"), [(96, 8), (100, 8), (7, 3), (5, 1)])
def test_gram_split_equals_the_gram(d_in, slices):
    a = jnp.asarray(np.random.default_rng(0).standard_normal((d_in, 6)), jnp.bfloat16)
    a64 = np.asarray(a.astype(jnp.float32), np.float64)
    got = np.asarray(bp.gram_split(a, slices), np.float64)
    np.testing.assert_allclose(got, a64.T @ a64, rtol=1e-5, atol=1e-5)


def test_layer_sums_add_each_piece_over_the_projections():
    rows = [dict(proj=p, r=r, **{f"{k}_us": float(i + 1) for k in bp.PIECES})
            for r in (4, 8) for i, p in enumerate("abc")]  # fmt: skip
    sums = {row["r"]: row for row in bp.layer_sums(rows)}
    assert set(sums) == {4, 8}
    assert all(sums[4][f"{k}_us"] == 6.0 for k in bp.PIECES)


def test_the_tiny_run_times_every_piece():
    rows = bp.run(tiny=True, ranks=[4], calls=2, reps=1, slices=3)
    assert [row["proj"] for row in rows] == [p for p, _, _ in bp.TINY]
    assert all(row[f"{k}_us"] > 0 for row in rows for k in bp.PIECES)
