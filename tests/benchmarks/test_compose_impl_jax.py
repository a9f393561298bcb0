"""``benchmarks/bench_compose_impl_jax.py`` on the CPU: both impls of the frozen-norm forward
run (Mosaic through Pallas' interpreter), agree, and are timed against each other."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import bench_compose_impl_jax as ci


def test_both_impls_give_the_layers_output():
    args = ci.layer(128, 128, 4, 64)
    x, kernel, a, b, m, norm = (np.asarray(v, np.float64) for v in args)
    inner = x @ kernel + ci.SCALING * (x @ a) @ b
    want = inner * (m / norm)[None, :]
    calls = ci.forwards(args, interpret=True)
    assert set(calls) == set(ci.IMPLS)
    for impl, call in calls.items():
        got = np.asarray(call(), np.float64)
        # bf16 activations: a few ulps (2^-8 relative) of the largest output
        np.testing.assert_allclose(got, want, rtol=0, atol=4 * 2**-8 * np.abs(want).max(),
                                   err_msg=impl)  # fmt: skip


def test_the_tiny_run_times_both_impls(tmp_path):
    rows = ci.main(["--tiny", "--ranks", "4", "--rounds", "1", "--per-round", "1",
                    "--out", str(tmp_path)])  # fmt: skip
    assert [r["impl"] for r in rows] == list(ci.IMPLS)
    assert all(r["us"] > 0 and r["mosaic_per_xla"] > 0 for r in rows)
    assert (tmp_path / "compose_impl_jax.csv").exists()
    with pytest.raises(SystemExit):
        ci.main(["--tiny", "--per-round", "0"])
