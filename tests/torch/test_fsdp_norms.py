"""``fsdp_norms.LocalNorms``'s capture-and-replay control flow, on the CPU with a stand-in
for CUDA graphs (the 2-rank gloo tests in tests/distributed run the computation itself; the
real capture needs a GPU)."""

from __future__ import annotations

import contextlib

import torch

from dora_torch import fsdp_norms


class _FakeGraph:
    """Records the function run under ``capture`` and re-runs it on ``replay``, writing into
    the tensors the capture returned (as a replay rewrites its static outputs)."""

    last = None

    def __init__(self):
        self.replays = 0
        _FakeGraph.last = self

    def replay(self):
        self.replays += 1
        self.out.copy_(self.fn())


def _plan(seed, d_out=6, d_in=10, r=3):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g)
    A = torch.randn(r, d_in, generator=g)
    B = torch.randn(d_out, r, generator=g)
    every = A.reshape(1, -1).clone()  # world = 1: the "gathered" A rows
    base_sq = (W * W).sum(1)
    plan = [(W, B, base_sq, 0.5, False, (0, A.numel(), r, A.shape), d_out)]
    return plan, every, (W, A, B)


def test_local_norms_capture_once_then_replay_current_values(monkeypatch):
    norms = fsdp_norms.LocalNorms([], lambda m: None, None)
    monkeypatch.setattr(norms, "_can_capture", lambda w: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    captured = {}

    @contextlib.contextmanager
    def fake_capture(graph):
        calls = []
        real = norms._norms_of_rows

        def recording(plan, every, dtype):
            out = real(plan, every, dtype)
            calls.append(lambda: real(plan, every, dtype))
            graph.out = out
            return out

        norms._norms_of_rows = recording
        try:
            yield
        finally:
            norms._norms_of_rows = real
            graph.fn = calls[0]
            captured["graph"] = graph

    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    plan, every, (_, _, B) = _plan(0)
    want = norms._norms_of_rows(plan, every, torch.float32)
    first = norms._local_rows(plan, every, torch.float32)  # first sight: eager
    assert "graph" not in captured
    second = norms._local_rows(plan, every, torch.float32)  # second: capture, then replay
    graph = captured["graph"]
    assert graph.replays == 1
    for got in (first, second):
        torch.testing.assert_close(got, want)
    with torch.no_grad():  # new adapter values at the same addresses: a replay sees them
        B.mul_(2.0)
        every.mul_(-1.0)
    third = norms._local_rows(plan, every, torch.float32)
    assert graph.replays == 2
    torch.testing.assert_close(third, norms._norms_of_rows(plan, every, torch.float32))
    assert not torch.allclose(third, want)
    kept = third.clone()
    with torch.no_grad():
        B.mul_(3.0)
    fourth = norms._local_rows(plan, every, torch.float32)
    torch.testing.assert_close(fourth, norms._norms_of_rows(plan, every, torch.float32))
    torch.testing.assert_close(third, kept)  # a replay never rewrites what was handed out
    # Other tensors (another address): eager again, no replay of the old graph.
    plan2, every2, _ = _plan(1)
    replays = graph.replays
    torch.testing.assert_close(
        norms._local_rows(plan2, every2, torch.float32),
        norms._norms_of_rows(plan2, every2, torch.float32),
    )
    assert graph.replays == replays


def test_local_norms_stay_eager_after_a_failed_capture(monkeypatch):
    norms = fsdp_norms.LocalNorms([], lambda m: None, None)
    monkeypatch.setattr(norms, "_can_capture", lambda w: not norms._failed)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)

    @contextlib.contextmanager
    def failing(graph):
        raise RuntimeError("capture refused")
        yield

    monkeypatch.setattr(torch.cuda, "graph", failing)
    plan, every, _ = _plan(2)
    want = norms._norms_of_rows(plan, every, torch.float32)
    for _ in range(3):
        torch.testing.assert_close(norms._local_rows(plan, every, torch.float32), want)
    assert norms._failed
