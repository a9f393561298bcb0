"""benchmarks/run.py (``make gpu``): every bench module it runs follows its protocol, and the
probes with their own command line are skipped instead of crashing the run."""

from __future__ import annotations

import importlib
import inspect

import pytest

from benchmarks import run as bench_run

NAMES = bench_run._bench_modules([])


@pytest.mark.parametrize("name", NAMES)
def test_every_bench_module_follows_the_protocol_or_opts_out(name):
    mod = importlib.import_module(f"benchmarks.{name}")
    if not bench_run.in_make_gpu(mod):
        return
    params = list(inspect.signature(mod.run).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_kw = [p for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    assert len(positional) == 1 and not required_kw, f"{name}.run{inspect.signature(mod.run)}"


def test_the_probes_opt_out_and_the_benches_stay_in():
    skipped = {
        n for n in NAMES if not bench_run.in_make_gpu(importlib.import_module(f"benchmarks.{n}"))
    }
    assert {"bench_jax_parts", "bench_jax_passes", "bench_norm_pass"} <= skipped
    assert {"bench_model_torch", "bench_model_jax", "bench_torch_layer"}.isdisjoint(skipped)
