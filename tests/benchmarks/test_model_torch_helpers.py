"""``benchmarks/bench_model_torch.norm_invalidator``: the ``infer_norm_recomputed_ms`` row
times ours with its norms made stale before every call, which holds only if one step of
the invalidator's optimizer step really makes the norms stale, eager calls' and the eval-mode
buffer that compiled graphs read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dora_torch
from benchmarks.bench_model_torch import norm_invalidator
from dora_torch import cache


def test_the_invalidator_makes_a_cached_norm_stale(monkeypatch):
    torch.manual_seed(0)
    layer = dora_torch.Linear.from_linear(nn.Linear(32, 16), r=4, lora_alpha=8).eval()
    x = torch.randn(8, 32)
    computed = []
    original = cache.compute_state

    def counting(*args, **kwargs):
        computed.append(1)
        return original(*args, **kwargs)

    with torch.no_grad():
        layer(x)  # caches the norm
        monkeypatch.setattr(cache, "compute_state", counting)
        layer(x)
        assert not computed  # a cache hit
        before = cache.optimizer_steps()
        norm_invalidator(layer)()
        assert len(computed) == 1  # the step's hook refreshed the eval-mode buffer
        layer(x)
    assert cache.optimizer_steps() == before + 1
    assert len(computed) == 1  # whose entry the eager call then reads


def test_the_recompute_provider_takes_work_floors_cheapest_set_and_is_summarised():
    """``ours_recompute_bf16`` recomputes the layers ``work_floor.cheapest_recompute`` picks
    for issue 10's batch-4 memory target, and the summary names it apart from ``ours``."""
    from benchmarks import bench_model_torch as bm
    from benchmarks import work_floor as wf

    r, batch, csv_name = wf.TORCH_MEMORY_TARGET
    lora = wf.model_peak_gib(csv_name, "peft_lora_bf16", r, batch)
    names, _ = wf.cheapest_recompute(lora, 1.05, tokens=batch * bm.SEQ)
    assert set(bm.RECOMPUTE["ours_recompute_bf16"]) == set(names)
    assert "ours_recompute_bf16" not in bm.DEFAULT_PROVIDERS
    both = "ours_recompute_stacked_bf16"  # the same set recomputed, every layer stacked
    assert bm.RECOMPUTE[both] == bm.RECOMPUTE["ours_recompute_bf16"] and bm.STACK[both] == ".*"
    assert both not in bm.DEFAULT_PROVIDERS
    row = dict(mode="eager", optim="foreach", rank=16, batch=4)
    rows = [
        {**row, "provider": "peft_lora_bf16", "train_ms": 100.0, "train_peak_gib": 10.0},
        {**row, "provider": "ours_bf16", "train_ms": 101.0, "train_peak_gib": 11.2},
        {**row, "provider": "ours_recompute_bf16", "train_ms": 104.0, "train_peak_gib": 10.4},
    ]
    got = {s["metric"].split(" [")[0]: s["value"] for s in bm._summary(rows)}
    assert got["ours/LoRA train"] == pytest.approx(1.01)
    assert got["ours_recompute/LoRA train"] == pytest.approx(1.04)
    assert got["ours_recompute/LoRA peak memory"] == pytest.approx(1.04)
