"""The whole demo on the ``micro`` config: PEFT vs ours, our file into PEFT and dora_jax."""

from __future__ import annotations

import csv

import pytest

pytest.importorskip("peft")
pytest.importorskip("flax")


@pytest.mark.parametrize("ours", ["inject", "accelerate"])
def test_demo_runs_and_passes_its_checks(tmp_path, ours):
    from examples.demo import main

    rc = main(["--config", "micro", "--steps", "3", "--ours", ours, "--out", str(tmp_path)])
    assert rc == 0
    with (tmp_path / "results.csv").open() as f:
        rows = {r["metric"]: r for r in csv.DictReader(f)}
    checks = {m: r["ok"] for m, r in rows.items() if r["target"]}
    assert len(checks) == 4 and set(checks.values()) == {"true"}, checks
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "loss.csv").read_text().count("\n") == 4  # header + 3 steps
