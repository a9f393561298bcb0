"""The CPU host-time harness reaches the fused tier's launch path and reports every variant."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_harness_times_the_fused_launch_path():
    # Its own process: the harness needs compiled-kernel objects (no TRITON_INTERPRET), and
    # main() raises if no Launcher took its fast path.
    env = dict(os.environ, TRITON_INTERPRET="0")
    args = ["--layers", "1", "--rounds", "2", "--per-round", "1", "--variants", "peft_lora", "ours"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_step_cpu", *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert "fwd" in lines["ours"] and "sum" in lines["ours"]
    assert "peft_lora" in lines


def test_harness_times_the_layer_row_and_names_wrong_variants():
    env = dict(os.environ, TRITON_INTERPRET="0")
    base = [sys.executable, "-m", "benchmarks.host_step_cpu", "--workload", "layer"]
    done = subprocess.run(
        [*base, "--rounds", "2", "--per-round", "1"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "excess over lora_eq" in done.stdout and "\nours " in done.stdout
    wrong = subprocess.run(
        [*base, "--variants", "peft_lora", "ours"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert wrong.returncode == 2 and "peft_lora" in wrong.stderr and "layer" in wrong.stderr


def test_harness_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_step_cpu", "--layers", "1"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "TRITON_INTERPRET" in done.stderr


def test_harness_times_the_step_hook():
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_step_cpu", "--workload", "step_hook",
         "--layers", "1", "--rounds", "2", "--per-round", "2"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "optimizer-step hook" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("ours "))
    assert float(row.split()[1]) > 0  # the hook's µs ('fwd' column)


def test_harness_times_the_training_step_with_its_optimizer():
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_step_cpu", "--workload", "train_step",
         "--layers", "1", "--rounds", "2", "--per-round", "2", "--variants", "peft_lora", "ours"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "AdamW foreach" in done.stdout and "opt µs" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("ours "))
    fwd, bwd, opt = (float(v) for v in row.split()[1:4])
    assert fwd > 0 and bwd > 0 and opt > 0  # the optimizer's own column
    assert "opt " in row and "sum" in row


def test_harness_times_the_compiled_forwards_guard_check():
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_step_cpu", "--workload", "guards",
         "--layers", "1", "--rounds", "2", "--per-round", "2"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "guard check" in done.stdout and "CPU tier" in done.stdout
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    assert float(rows["peft_lora"][1]) > 0 and float(rows["ours"][1]) > 0  # µs per check
