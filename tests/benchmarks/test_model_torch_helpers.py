"""``benchmarks/bench_model_torch.norm_invalidator``: the ``infer_norm_recomputed_ms`` row
times ours with its norms made stale before every call, which holds only if one step of
the dummy optimizer really invalidates a cached norm."""

from __future__ import annotations

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
        norm_invalidator("cpu")()
        layer(x)
    assert cache.optimizer_steps() == before + 1
    assert computed  # recomputed (by the step's eval-mode refresh or by the call)
