"""``benchmarks/bench_stacked_gemm.py`` on the CPU: both forms of each pass compute the
layer's products (against float64), and the tiny run times both forms and adds up a step."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_stacked_gemm as sg


def _f64(t):
    return t.detach().double()


@pytest.mark.parametrize("form", sg.FORMS)
def test_each_form_computes_the_layers_products(form):
    o = sg.Operands(24, 40, 32, 8, dtype=torch.float32, device="cpu")
    x, w, a, b, dyg, s = map(_f64, (o.x, o.weight, o.a, o.b, o.dyg, torch.tensor(o.scaling)))
    base, h = sg.CALLS["fwd", form](o)
    torch.testing.assert_close(_f64(base), x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_f64(h), x @ a.T, rtol=1e-5, atol=1e-5)
    dx, st = sg.CALLS["bwd", form](o)
    t = dyg @ b
    torch.testing.assert_close(_f64(st), s * t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_f64(dx), dyg @ w + s * t @ a, rtol=1e-5, atol=1e-5)
    # a control: the low-rank term is not small here, so a form that dropped it would fail
    assert float((dyg @ w - _f64(dx)).abs().max()) > 0.1


def test_stacked_operands_share_one_buffer():
    o = sg.Operands(8, 16, 12, 4, dtype=torch.float32, device="cpu")
    base, h = sg.fwd_stacked(o)
    assert base.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    torch.testing.assert_close(o.G[:, :16], o.dyg, rtol=0, atol=0)


def test_the_tiny_run_times_both_forms(tmp_path):
    rows, step_rows = sg.main(["--tiny", "--ranks", "4", "--tokens", "16", "--rounds", "2",
                               "--per-round", "2", "--out", str(tmp_path)])  # fmt: skip
    assert [(r["proj"], r["pass"]) for r in rows] == [
        (p[0], name) for p in sg.TINY_PROJECTIONS for name in sg.PASSES
    ]
    assert all(r["host_separate_us"] > 0 and r["host_stacked_us"] > 0 for r in rows)
    assert all(r["max_abs_diff"] < 1e-4 for r in rows)
    assert [(r["r"], r["tokens"]) for r in step_rows] == [(4, 16)]
    assert "host_saved_ms_per_step" in step_rows[0]
    assert (tmp_path / "stacked_gemm.csv").exists()
    assert (tmp_path / "stacked_gemm_step.csv").exists()
    for bad in (["--rounds", "0"], ["--ranks", "0"]):
        with pytest.raises(SystemExit):
            sg.main(["--tiny", *bad])
