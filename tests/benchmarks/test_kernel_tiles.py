"""``benchmarks/bench_kernel_tiles.py`` on the CPU: its forms compute the layer's compose
and scale-and-reduce pass (against float64), and the tiny run reports every candidate."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_kernel_tiles as kt


def _f64(o):
    return (t.double() for t in (o.h, o.b, o.base0, o.m, o.n, o.dy, o.y))


@pytest.mark.parametrize("name", ["chosen", *kt.TINY_COMPOSE])
def test_each_compose_form_composes_the_layer(name):
    o = kt.Operands(19, 40, 8, dtype=torch.float32, device="cpu")
    h, b, base, m, n, _, _ = _f64(o)
    want = (m / n) * (base + o.s * h @ b.T)
    got = kt.form("compose", name, o)()[0].double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a control: the low-rank term is not small, so a form that dropped it would fail
    assert float(((m / n) * base - want).abs().max()) > 0.1


@pytest.mark.parametrize("name", ["chosen", *kt.TINY_SCALE_REDUCE])
def test_each_pass_form_scales_and_reduces(name):
    o = kt.Operands(300, 40, 8, dtype=torch.float32, device="cpu")
    _, _, _, m, n, dy, y = _f64(o)
    dyg, _, dm, _ = kt.form("scale_reduce", name, o)()
    g = m / n
    torch.testing.assert_close(dyg.double(), g * dy, rtol=1e-6, atol=1e-6)
    # recover mode: inner = y / g, dm = Σ_t dy ⊙ inner / n
    torch.testing.assert_close(dm.double(), (dy * y / g).sum(0) / n, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["chosen", *kt.TINY_NORM])
def test_each_norm_form_assembles_the_norm(name):
    o = kt.Operands(5, 40, 24, dtype=torch.float32, device="cpu")
    b, u, g, base_sq = (t.double() for t in (o.b, o.u, o.g, o.base_sq))
    want = (base_sq + (b * (2 * o.s * u + o.s**2 * (b @ g))).sum(1)).sqrt()
    got = kt.form("norm", name, o)().double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    # a control: the B·G term is not small, so a form that dropped it would fail
    assert float(((base_sq + (b * 2 * o.s * u).sum(1)).sqrt() - want).abs().max()) > 1e-4


def test_the_tiny_run_reports_every_candidate(tmp_path):
    rows = kt.main(["--tiny", "--ranks", "4", "--tokens", "300", "--out", str(tmp_path)])
    assert [(r["kernel"], r["d_out"], r["form"]) for r in rows] == [
        (kernel, d_out, name)
        for kernel, names in (
            ("compose", kt.TINY_COMPOSE),
            ("scale_reduce", kt.TINY_SCALE_REDUCE),
            ("norm", kt.TINY_NORM),
        )
        for d_out in (48, 80)
        for name in names
    ]
    assert all(r["max_rel_diff"] < 1e-5 for r in rows)
    assert (tmp_path / "kernel_tiles.csv").exists()
    for bad in (["--rounds", "0"], ["--ranks", "0"]):
        with pytest.raises(SystemExit):
            kt.main(["--tiny", *bad])
    with pytest.raises(SystemExit):
        kt.main(["--tiny", "--kernels", "nope"])


@pytest.mark.parametrize("kernel", kt.KERNELS)
def test_candidates_are_distinct_configs(kernel):
    configs = list(kt.candidates(kernel).values())
    assert len(set(configs)) == len(configs)


def test_only_the_form_the_library_runs_is_marked_chosen():
    assert kt._chosen("norm", 2048, 4096, 384) == "pairs"  # "auto" at r = 384, 16-bit layer
    marked = [n for n in ("chosen", *kt.NORM_FORMS, "copy")
              if kt._is_chosen("norm", n, kt.candidates("norm").get(n), "pairs")]  # fmt: skip
    assert marked == ["chosen", "pairs"]
    square = kt.config.LORA_GEMM_SQUARE
    assert kt._is_chosen("compose", "sq128_w4", kt.COMPOSE_CANDIDATES["sq128_w4"], square)
    assert not kt._is_chosen("compose", "copy", None, square)
