"""``benchmarks/ncu_jax_layer.py`` on the CPU: the provider's call runs (without the profiler
range), and wrong arguments are refused by name before anything is built."""

from __future__ import annotations

import pytest

from benchmarks import bench_jax_layer as bj
from benchmarks import ncu_jax_layer as ncu

TINY = [("tiny", 64, 128, 4, 64, "train"), ("tiny_infer", 64, 128, 4, 64, "infer")]


@pytest.mark.parametrize(
    ("shape", "provider", "kind"),
    [("tiny", "ours_xla", "grad"), ("tiny_infer", "ours_xla", "fwd")],
)
def test_one_call_runs_on_the_cpu(monkeypatch, shape, provider, kind):
    monkeypatch.setattr(bj, "SHAPES", TINY)
    monkeypatch.setattr(bj, "PROVIDERS", [])
    ncu.one_call(shape, provider, kind, dry=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shape_name": "nope"}, "shape must be one of"),
        ({"kind": "bwd"}, "kind must be"),
        ({"provider": "peft"}, "provider must be one of"),
    ],
)
def test_wrong_arguments_are_named(monkeypatch, kwargs, match):
    monkeypatch.setattr(bj, "SHAPES", TINY)
    monkeypatch.setattr(bj, "PROVIDERS", [])
    args = {"shape_name": "tiny", "provider": "ours_xla", "kind": "fwd", **kwargs}
    with pytest.raises(ValueError, match=match):
        ncu.one_call(args.pop("shape_name"), args.pop("provider"), args.pop("kind"), dry=True)
