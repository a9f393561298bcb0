"""Smoke test of examples/scalora_evidence.py on the ``micro`` config: three steps, one lr,
all five methods; the CSV, curves, plot and log are written with sane values."""

from __future__ import annotations

import csv
import math

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

METHODS = {"lora", "scalora", "scalora_i", "dora", "dora_scalora"}


def test_evidence_script_writes_all_methods(tmp_path):
    import torch

    from examples.configs import get_config
    from examples.scalora_evidence import CSV_FIELDS, main

    threads = torch.get_num_threads()
    out = tmp_path / "ev"
    argv = ["--config", "micro", "--steps", "3", "--lrs", "3e-3", "--interval", "2",
            "--eval-every", "2", "--eval-windows", "4", "--out", str(out)]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # main() sets --threads; leave the process as it was
    r = get_config("micro").rank
    with open(f"{out}.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == CSV_FIELDS
        rows = {row["method"]: row for row in reader}
    assert set(rows) == METHODS
    for m, row in rows.items():
        assert row["best"] == "true" and row["lr"] == "0.003" and int(row["steps"]) == 3, m
        assert row["status"] == "ok", m
        for k in ("final_train_loss", "heldout_loss", "train_s", "ms_per_step", "rank_mean",
                  "rank_mean_10x_rtol", "stable_rank_mean", "lora_A_norm_mean"):  # fmt: skip
            assert math.isfinite(float(row[k])), (m, k, row[k])
        # byte-level LM from random weights: about ln(258) = 5.55 nats/byte after 3 steps
        assert 4.0 < float(row["heldout_loss"]) < 6.5, (m, row["heldout_loss"])
        assert int(row["r"]) == r and int(row["layers"]) == 2 * 7  # 2 blocks × 7 projections
        assert 1 <= int(row["rank_min"]) <= float(row["rank_mean"]) <= int(row["rank_max"])
        assert float(row["rank_mean_10x_rtol"]) <= float(row["rank_mean"])
        assert float(row["lora_B_norm_mean"]) > 0  # lora_B left 0 after the first step
    # LoRA's accumulated update s·B·A has rank ≤ r; ScaLoRA merges a rank-r term into the base
    # at every merge, so its update can (and here does) exceed r. ScaLoRA-I (I=2) merged at
    # steps 0 and 2: the step-0 merge is empty (lora_B = 0), so it can reach 2r as well.
    for m in ("lora", "dora"):
        assert int(rows[m]["rank_max"]) <= r, rows[m]
        assert rows[m]["merges"] == "0" and rows[m]["column_frac"] == ""
    for m in ("scalora", "dora_scalora"):
        assert int(rows[m]["rank_max"]) > r, rows[m]
        assert rows[m]["merges"] == "3" and 0.0 <= float(rows[m]["column_frac"]) <= 1.0
    assert rows["scalora_i"]["merges"] == "2"
    with open(f"{out}.curves.csv", newline="") as f:
        kinds = [(row["method"], row["kind"]) for row in csv.DictReader(f)]
    for m in METHODS:
        assert kinds.count((m, "train")) == 3 and kinds.count((m, "heldout")) == 3  # 0, 2, 3
    log = (tmp_path / "ev.log").read_text(encoding="utf-8")
    assert "command: python -m examples.scalora_evidence --config micro" in log
    assert "DoRA+ScaLoRA" in log and "'name': 'micro'" in log
    png = tmp_path / "ev.png"
    if png.exists():  # written when matplotlib is installed
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evidence_script_pretrains_the_base_on_text_the_adapters_do_not_see(tmp_path):
    import torch

    from examples import scalora_evidence as ev
    from examples.configs import get_config
    from examples.corpus import ByteTokenizer
    from examples.training import build_base_model

    cfg = get_config("micro")
    base = build_base_model(cfg, vocab_size=ByteTokenizer().vocab_size, seed=0)
    before = [p.detach().clone() for p in base.parameters()]
    train_ids, _ = ev.split_corpus(0.1)
    threads = torch.get_num_threads()
    try:
        loss = ev.pretrain(base, cfg, train_ids[: len(train_ids) // 2], steps=3, lr=3e-3, seed=1)
        assert math.isfinite(loss)
        assert all(not torch.equal(a, b) for a, b in zip(before, base.parameters()))
        assert not base.training  # left in eval mode, as build_base_model returns it
        out = tmp_path / "pre"
        argv = ["--config", "micro", "--steps", "2", "--lrs", "3e-3", "--methods", "lora",
                "--eval-every", "2", "--eval-windows", "4", "--pretrain-steps", "2",
                "--out", str(out)]  # fmt: skip
        assert ev.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    log = (tmp_path / "pre.log").read_text()
    assert "pretrain_steps=2" in log and "base pretrained 2 steps" in log
    half = len(train_ids) // 2
    assert f"on the first {half} training bytes" in log
    assert f"adapters train on the other {len(train_ids) - half} bytes" in log
    with pytest.raises(SystemExit):
        ev.parse_args(["--pretrain-steps", "-1"])
