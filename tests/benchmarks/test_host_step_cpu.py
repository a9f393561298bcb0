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


def _harness(*args: str, interpret: str = "0") -> subprocess.CompletedProcess:
    """``python -m benchmarks.host_step_cpu ARGS`` in its own process: the harness needs
    compiled-kernel objects (no TRITON_INTERPRET), and main() raises if no Launcher took its
    fast path."""
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.host_step_cpu", *args],
        env=dict(os.environ, TRITON_INTERPRET=interpret),
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _row(stdout: str, variant: str) -> list[str]:
    return next(line for line in stdout.splitlines() if line.startswith(f"{variant} ")).split()


def test_harness_times_the_fused_launch_path():
    done = _harness("--layers", "1", "--rounds", "2", "--per-round", "1",
                    "--variants", "peft_lora", "ours")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert "fwd" in lines["ours"] and "sum" in lines["ours"]
    assert "peft_lora" in lines


def test_harness_times_the_layer_row_and_names_wrong_variants():
    done = _harness("--workload", "layer", "--rounds", "2", "--per-round", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "excess over lora_eq" in done.stdout and "\nours " in done.stdout
    wrong = _harness("--workload", "layer", "--variants", "peft_lora", "ours")
    assert wrong.returncode == 2 and "peft_lora" in wrong.stderr and "layer" in wrong.stderr


def test_harness_refuses_the_interpreter():
    done = _harness("--layers", "1", interpret="1")
    assert done.returncode == 2 and "TRITON_INTERPRET" in done.stderr


def test_harness_times_the_step_hook():
    done = _harness("--workload", "step_hook", "--layers", "1", "--rounds", "2",
                    "--per-round", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "optimizer-step hook" in done.stdout
    assert float(_row(done.stdout, "ours")[1]) > 0  # the hook's µs ('fwd' column)


def test_harness_times_the_training_step_with_its_optimizer():
    done = _harness("--workload", "train_step", "--layers", "1", "--rounds", "2",
                    "--per-round", "2", "--variants", "peft_lora", "ours")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "AdamW foreach" in done.stdout and "opt µs" in done.stdout
    row = _row(done.stdout, "ours")
    fwd, bwd, opt = (float(v) for v in row[1:4])
    assert fwd > 0 and bwd > 0 and opt > 0  # the optimizer's own column
    assert "opt" in row and "sum" in row


def test_harness_times_the_compiled_forwards_guard_check():
    done = _harness("--workload", "guards", "--layers", "1", "--rounds", "2",
                    "--per-round", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "guard check" in done.stdout and "CPU tier" in done.stdout
    for variant in ("peft_lora", "ours"):
        assert float(_row(done.stdout, variant)[1]) > 0  # µs per check
