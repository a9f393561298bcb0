"""``benchmarks/bench_dx_add_jax.py`` on the CPU: every form of the down projection's dx
computes the same product, the beta parser reads cuBLAS configs, and the tiny run times
every form against ``current``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks import bench_dx_add_jax as dx


def test_every_form_computes_dy_k_plus_q_a():
    dy, k, q, a = dx.operands(*dx.TINY_SHAPE, 8)
    f = lambda v: np.asarray(v, np.float64)  # noqa: E731
    want = f(dy) @ f(k).T + f(q) @ f(a).T
    scale = np.abs(want).max()
    for name, fn in dx._forms().items():
        got = f(jax.jit(fn)(dy, k, q, a))
        if name == "gemm_only":
            np.testing.assert_allclose(got, f(dy) @ f(k).T, rtol=0, atol=2e-2 * scale)
            # a control: the low-rank term is not small here, so dropping it shows
            assert np.abs(got - want).max() > 0.1 * scale
            continue
        # bf16 rounds up to three times (each dot, then their sum): three half-ulps of 2^-7
        # are 1.2e-2 of the largest value
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * scale, err_msg=name)


def test_betas_reads_every_cublas_call():
    text = '"gemm_backend_config":{"alpha_real":1,"beta":0,...} ... {"beta":1,"epilogue":"DEFAULT"}'
    assert dx.betas(text) == ["0", "1"]
    assert dx.betas("fusion(...) no GEMMs") == []


def test_the_tiny_run_times_every_form(tmp_path):
    rows = dx.main(["--tiny", "--ranks", "4", "--rounds", "2", "--per-round", "2",
                    "--out", str(tmp_path)])  # fmt: skip
    assert [r["form"] for r in rows] == list(dx.FORMS)
    assert all(r["us"] > 0 for r in rows)
    assert next(r for r in rows if r["form"] == "current")["per_current"] == pytest.approx(1.0)
    assert (tmp_path / "dx_add_jax.csv").exists()
    with pytest.raises(SystemExit):
        dx.main(["--tiny", "--rounds", "0"])
