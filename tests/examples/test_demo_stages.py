"""The demo's stages that do not need our backends: data, training loop, report, cosines.

Everything runs on the CPU in seconds with the ``micro`` config; the full demo (which needs
dora_torch and dora_jax) is exercised end to end in ``test_demo_end_to_end.py``.
"""

from __future__ import annotations

import copy
import csv
import math

import numpy as np
import pytest
import torch

from examples import corpus
from examples.configs import TARGET_MODULES, get_config
from examples.corpus import ByteTokenizer, load_text, sample_batches
from examples.parity import min_cosine, token_cosines
from examples.report import Row, format_table, write_curves_csv
from examples.training import TrainResult


def test_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "In the beginning — héllo ✓\n"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids.dtype == np.int64
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert ids.max() < tok.vocab_size == 258
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert tok.decode(ids) == text  # specials are dropped
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"  # invalid UTF-8 never raises


def test_corpus_files_load_and_are_in_budget():
    texts = {name: load_text(name) for name in (corpus.TRAIN_FILE, corpus.EVAL_FILE)}
    total = sum(len(t.encode("utf-8")) for t in texts.values())
    assert 50_000 <= total <= 200_000
    for name, text in texts.items():
        assert text.isascii(), name
        assert len(text.splitlines()) > 50, name
    assert "In the beginning God created the heaven and the earth." in texts[corpus.TRAIN_FILE]
    with pytest.raises(ValueError, match=r"no corpus file named 'missing\.txt'"):
        load_text("missing.txt")


def test_sample_batches_are_windows_and_deterministic():
    tokens = np.arange(1000, dtype=np.int64)
    b = sample_batches(tokens, batch_size=3, seq_len=16, steps=5, seed=7)
    assert b.shape == (5, 3, 17)
    np.testing.assert_array_equal(np.diff(b, axis=-1), 1)  # contiguous slices of the text
    np.testing.assert_array_equal(
        b, sample_batches(tokens, batch_size=3, seq_len=16, steps=5, seed=7)
    )
    assert not np.array_equal(b, sample_batches(tokens, batch_size=3, seq_len=16, steps=5, seed=8))
    with pytest.raises(ValueError, match="seq_len"):
        sample_batches(tokens, batch_size=3, seq_len=0, steps=5, seed=0)
    with pytest.raises(ValueError, match="need more than"):
        sample_batches(tokens[:10], batch_size=1, seq_len=16, steps=1, seed=0)


def test_stage_data_shapes():
    from examples.demo import stage_data

    cfg = get_config("micro")
    batches, eval_ids, tok = stage_data(cfg, seed=0)
    assert batches.shape == (cfg.steps, cfg.batch_size, cfg.seq_len + 1)
    assert eval_ids.shape[1] == cfg.seq_len and eval_ids.shape[0] >= 1
    assert batches.max() < tok.vocab_size


class _PeftTwin:
    """A stand-in for ours that is PEFT itself: the loop must then give identical losses."""

    name = "PEFT twin"

    def from_peft(self, peft_model, work_base):
        return copy.deepcopy(peft_model)


def test_training_loop_runs_and_is_deterministic():
    """Two identical PEFT DoRA models on the same batches: identical losses, which fall."""
    from examples.demo import stage_data, stage_train
    from examples.training import build_base_model

    cfg = get_config("micro")
    batches, _, tok = stage_data(cfg, seed=0)
    batches = np.concatenate([batches[:1]] * 3)  # the same batch thrice: loss must drop
    base = build_base_model(cfg, vocab_size=tok.vocab_size, seed=0)
    before = copy.deepcopy(base.state_dict())
    pair = stage_train(
        base, cfg, batches, device="cpu", dtype=torch.float32, seed=0, ours=_PeftTwin()
    )
    for res in (pair.peft, pair.ours):
        assert len(res.losses) == len(res.step_ms) == 3
        assert all(math.isfinite(v) for v in res.losses)
        assert res.losses[-1] < res.losses[0]
        assert res.peak_bytes >= 0 and res.median_step_ms > 0
    assert pair.peft.losses == pair.ours.losses
    # The base model is left as it was, and DoRA went on all seven projections.
    for k, v in base.state_dict().items():
        assert np.array_equal(v.numpy(), before[k].numpy()), k
    names = [n for n, _ in pair.peft_model.named_modules() if n.endswith("lora_magnitude_vector")]
    assert len(names) == cfg.layers * len(TARGET_MODULES)


def _result(losses):
    return TrainResult(list(losses), [10.0] * len(losses), 2**20, "test")


def test_report_rows_csv_and_png(tmp_path):
    from examples.demo import PairResult, stage_report, summary_rows

    pair = PairResult(_result([5.0, 4.0, 3.0]), _result([5.0, 4.0005, 3.002]), None, None)
    cos = {"trained_models": 0.9999, "peft_reload": 0.999999, "jax_twin": 0.99}
    rows = summary_rows(pair, cos, dtype_name="fp32")
    verdict = {r.metric: r.ok for r in rows if r.is_check}
    assert verdict["mean |loss_PEFT - loss_ours| per step"] is False  # 8.3e-4 > 1e-4
    assert verdict["max |loss_PEFT - loss_ours| per step"] is False  # 2e-3 > 1e-3
    assert verdict["logit cosine, PEFT from_pretrained(our file) vs ours (min/token)"] is True
    assert verdict["logit cosine, dora_jax twin (our file) vs ours, fp32 (min/token)"] is False

    table = stage_report(pair, rows, tmp_path, title="test")
    assert "FAIL" in table and "metric" in table.splitlines()[0]
    with (tmp_path / "results.csv").open() as f:
        got = list(csv.DictReader(f))
    assert [r["metric"] for r in got] == [r.metric for r in rows]
    assert {r["ok"] for r in got} == {"", "true", "false"}
    with (tmp_path / "loss.csv").open() as f:
        curves = list(csv.DictReader(f))
    assert [float(r["loss_ours"]) for r in curves] == pair.ours.losses
    pytest.importorskip("matplotlib")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_row_checks():
    assert Row("a", value=1e-5, limit=1e-4).ok is True
    assert Row("a", value=float("nan"), limit=1e-4).ok is False
    assert Row("a", value=0.5, limit=0.9, at_least=True).ok is False
    assert Row("a", peft=1.0, ours=2.0).ok is None
    assert "<= 1.000e-04" in format_table([Row("a", value=1e-5, limit=1e-4)])
    with pytest.raises(ValueError, match="equal lengths"):
        write_curves_csv("unused.csv", {"a": [1.0], "b": [1.0, 2.0]})


def test_cosines():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 10))
    assert min_cosine(a, a) == pytest.approx(1.0)
    assert min_cosine(a, -a) == pytest.approx(-1.0)
    assert token_cosines(a, a).shape == (6,)
    b = a.copy()
    b[0, 0, 0] = np.nan
    assert math.isnan(min_cosine(a, b))
    z = np.zeros_like(a)
    assert token_cosines(a, z).max() == 0.0
    with pytest.raises(ValueError, match="equal shapes"):
        token_cosines(a, a[:1])


def test_cli_defaults():
    from examples.demo import parse_args

    args = parse_args([])
    assert (args.device, args.config, args.dtype, args.steps) == ("cpu", "tiny", "fp32", None)
    assert parse_args(["--device", "cuda"]).dtype == "bf16"
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    with pytest.raises(ValueError, match="unknown config 'huge'"):
        get_config("huge")
