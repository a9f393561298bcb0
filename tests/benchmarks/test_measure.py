"""``benchmarks/measure.py``'s shared helpers on the CPU: rounds of host timing, and the
positive-int flag type."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import measure


def test_torch_time_rounds_times_every_call_in_turn():
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b")}
    times = measure.torch_time_rounds(calls, rounds=3, per_round=2, timing="host")
    assert set(times) == {"a", "b"}
    assert all(len(t) == 3 and min(t) > 0 for t in times.values())
    # one call each before the rounds, then per round a's two calls, then b's
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3


def test_positive_int_names_the_flag(capsys):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=measure.positive_int, nargs="+")
    assert ap.parse_args(["--ranks", "1", "384"]).ranks == [1, 384]
    for bad in ("0", "-2", "x"):
        with pytest.raises(SystemExit):
            ap.parse_args(["--ranks", bad])
        assert "--ranks" in capsys.readouterr().err
