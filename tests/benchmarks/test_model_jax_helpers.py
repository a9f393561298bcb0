"""bench_model_jax: the A/B switch of the bf16x3 Gram product (set for one provider,
restored), the interleaved rounds of the training steps and the ratios taken from them, and a
tiny end-to-end run on the CPU."""

from __future__ import annotations

import csv

import pytest

from benchmarks import bench_model_jax as bm
from benchmarks.measure import jax_time_rounds, paired_ratio
from dora_jax import config


def test_norm_gemm_switch_is_restored_after_an_error():
    assert config.NORM_GEMM_BF16X3 is True
    with pytest.raises(RuntimeError, match="provider failed"):
        with bm.norm_gemm_bf16x3(False):
            assert config.NORM_GEMM_BF16X3 is False
            raise RuntimeError("provider failed")
    assert config.NORM_GEMM_BF16X3 is True


def test_rounds_let_the_calls_take_turns():
    order = []
    calls = {name: (lambda name=name: order.append(name) or 0.0) for name in ("a", "b")}
    times = jax_time_rounds(calls, rounds=3, per_round=2, warmup=1)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3  # warm-ups, then one turn per round
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}


def test_the_paired_ratio_is_the_median_of_per_round_ratios():
    # a drift that slows round 2 for both sides leaves every per-round ratio at 1.1
    times = {"ours": [11.0, 22.0, 11.0], "lora": [10.0, 20.0, 10.0]}
    assert paired_ratio(times, "ours", "lora") == pytest.approx(1.1)
    assert paired_ratio(times, "ours", "absent") is None
    with pytest.raises(ValueError):  # rounds of unequal count are not pairs
        paired_ratio({"a": [1.0], "b": [1.0, 2.0]}, "a", "b")


def test_back_to_back_rounds_wait_once_per_round(monkeypatch):
    import jax

    waits = []
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waits.append(x) or x)
    calls = {"a": iter(range(100)).__next__}
    times = jax_time_rounds(calls, rounds=2, per_round=4, warmup=0, back_to_back=True)
    assert waits == [3, 7]  # the last result of each round, nothing in between
    assert len(times["a"]) == 2


def test_training_ratios_come_from_the_rounds():
    by_name = {"jnp_lora": {"train_ms": 10.0, "grad_ms": 8.0},
               "ours_bf16": {"train_ms": 30.0, "grad_ms": 9.0}}  # fmt: skip
    timed = {"train_rounds_ms": {"jnp_lora": [10.0, 12.0], "ours_bf16": [10.5, 12.6]},
             "train_loop_ms": {"jnp_lora": [9.0, 10.0], "ours_bf16": [9.9, 11.0]}}  # fmt: skip
    rows = {r["metric"]: r for r in bm._summary(by_name, timed, 2, 16)}
    waited = (
        "ours_bf16 / jnp LoRA bf16, training step (rounds, each step waited for) time [2L r=16]"
    )
    loop = "ours_bf16 / jnp LoRA bf16, training step (rounds, steps back to back) time [2L r=16]"
    assert rows[waited]["value"] == pytest.approx(1.05)  # not 30 / 10 from the sequential rows
    assert "target" not in rows[waited]
    assert rows[loop]["value"] == pytest.approx(1.1) and rows[loop]["ok"] is False
    assert rows["ours_bf16 / jnp LoRA bf16, grad step time [2L r=16]"]["value"] == pytest.approx(
        9 / 8
    )
    assert not any("training" in k for k in bm._summary(by_name, {}, 2, 16))


def test_rounds_are_refused_below_one(monkeypatch):
    monkeypatch.setenv("DORA_BENCH_JAX_ROUNDS", "0")
    with pytest.raises(ValueError, match="DORA_BENCH_JAX_ROUNDS"):
        bm.rounds()
    monkeypatch.setenv("DORA_BENCH_JAX_LOOP_STEPS", "0")
    with pytest.raises(ValueError, match="DORA_BENCH_JAX_LOOP_STEPS"):
        bm.loop_steps()
    monkeypatch.setenv("DORA_BENCH_JAX_LOOP_STEPS", "3")
    assert bm.loop_steps() == 3


def test_the_tiny_run_times_every_training_step_in_rounds(tmp_path, monkeypatch):
    monkeypatch.setenv("DORA_BENCH_JAX_TINY", "1")
    monkeypatch.setenv("DORA_BENCH_JAX_LAYERS", "1")
    monkeypatch.setenv("DORA_BENCH_JAX_RANKS", "4")
    monkeypatch.setenv("DORA_BENCH_JAX_ROUNDS", "2")
    monkeypatch.setenv("DORA_BENCH_JAX_LOOP_STEPS", "2")
    monkeypatch.setenv("DORA_BENCH_JAX_PROVIDERS", "jnp_lora,ours_bf16")
    summary = bm.run(tmp_path)
    with open(tmp_path / "model_jax.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["provider"] for r in rows] == ["jnp_lora", "ours_bf16"]
    assert all(float(r["train_rounds_ms"]) > 0 and float(r["train_loop_ms"]) > 0 for r in rows)
    assert not any(r["error"] for r in rows)
    metrics = {r["metric"] for r in summary}
    assert (
        "ours_bf16 / jnp LoRA bf16, training step (rounds, steps back to back) time [1L r=4]"
        in metrics
    )


def test_the_loop_column_runs_loop_steps_back_to_back(monkeypatch):
    from benchmarks import measure

    seen = []

    def fake(calls, *, rounds, per_round, back_to_back):
        seen.append((back_to_back, per_round, rounds))
        return {name: [1.0] * rounds for name in calls}

    monkeypatch.setattr(measure, "jax_time_rounds", fake)
    monkeypatch.setenv("DORA_BENCH_JAX_ROUNDS", "3")
    monkeypatch.setenv("DORA_BENCH_JAX_LOOP_STEPS", "7")
    out = bm._train_rounds({"a": lambda: None})
    assert set(out) == set(bm.ROUND_KINDS)
    assert sorted(seen) == [(False, 5, 3), (True, 7, 3)]
