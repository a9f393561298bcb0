"""``benchmarks/bench_step_interleaved.variants_for``: which variants a mode times (compiled
graphs are traced with the dora_torch config of their first call, so compiled rounds cannot
switch it per step; Inductor options mean nothing in eager mode)."""

from __future__ import annotations

import pytest

from benchmarks.bench_step_interleaved import INDUCTOR_OPTIONS, VARIANTS, variants_for


def test_eager_runs_every_variant_without_inductor_options():
    assert variants_for("eager") == [n for n in VARIANTS if n not in INDUCTOR_OPTIONS]
    assert "ours_layer_norms" in variants_for("eager")


@pytest.mark.parametrize("mode", ["compile", "reduce-overhead"])
def test_compiled_modes_run_only_variants_without_config_overrides(mode):
    got = variants_for(mode)
    assert got == ["peft_lora", "ours", "ours_static_launch", "peft_dora"]
    assert variants_for(mode, {"peft_lora", "ours", "ours_layer_norms"}) == ["peft_lora", "ours"]


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="mode must be one of"):
        variants_for("jit")
