"""The convergence bench's verdict per adapter setting (``benchmarks/bench_convergence.py``),
on made-up loss curves: ours is judged against the larger of PEFT's two rerun spreads."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.bench_convergence import CROSS_FLOOR, FLOORS, JOBS, setting_summary, settings


def _runs(ours_offset: float, floor_offsets=(0.01, 0.02)) -> dict:
    peft = np.linspace(5.0, 1.0, 50)
    got = {"peft": SimpleNamespace(losses=peft.tolist()),
           "ours": SimpleNamespace(losses=(peft + ours_offset).tolist())}  # fmt: skip
    for kind, off in zip(FLOORS, floor_offsets):
        got[kind] = SimpleNamespace(losses=(peft - off).tolist())
    assert set(got) == set(JOBS)
    return got


def _verdicts(rows) -> dict:
    return {r["metric"].split(" (")[0]: r.get("ok") for r in rows}


@pytest.mark.parametrize(("offset", "within"), [(0.015, True), (0.025, False)])
def test_ours_is_judged_against_the_larger_floor(offset, within):
    rows, curves, delta = setting_summary("bf16", _runs(offset), 50)
    verdict = _verdicts(rows)
    assert verdict["mean |Δloss| within PEFT's own floor"] is within
    assert verdict["max |Δloss| within PEFT's own floor"] is within
    assert np.allclose(delta, offset)
    assert set(curves) == {"loss_peft", "loss_ours", "abs_delta", *(f"loss_{k}" for k in FLOORS),
                           *(f"abs_delta_{k}" for k in FLOORS)}  # fmt: skip
    assert all("bf16 adapters" in r["metric"] for r in rows)


def test_the_other_adapter_setting_widens_the_floor_and_the_rerun_ratio_stays():
    """PEFT's run in the other adapter setting joins the floor when both settings ran; the
    ratio to the same-setting reruns alone is still reported."""
    got = _runs(0.025)
    got[CROSS_FLOOR] = SimpleNamespace(losses=(np.asarray(got["peft"].losses) + 0.03).tolist())
    rows, curves, _ = setting_summary("fp32", got, 50)
    verdict = _verdicts(rows)
    assert verdict["mean |Δloss| within PEFT's own floor"] is True
    values = {r["metric"].split(" (")[0]: r["value"] for r in rows}
    assert values["mean |Δloss| / same-setting rerun floor"] == pytest.approx(0.025 / 0.02)
    assert f"abs_delta_{CROSS_FLOOR}" in curves


def test_settings_are_checked(monkeypatch):
    monkeypatch.setenv("DORA_BENCH_CONV_ADAPTERS", "bf16")
    assert settings() == ["bf16"]
    monkeypatch.setenv("DORA_BENCH_CONV_ADAPTERS", "fp16")
    with pytest.raises(ValueError, match="DORA_BENCH_CONV_ADAPTERS"):
        settings()
