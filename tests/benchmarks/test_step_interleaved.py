"""``benchmarks/bench_step_interleaved``: which variants a mode times (``variants_for``:
compiled graphs are traced with the dora_torch config of their first call, so compiled rounds
cannot switch it per step; Inductor options mean nothing in eager mode), and the summary's
ratios (``ratios``: each optimizer's rows against PEFT LoRA under the same optimizer)."""

from __future__ import annotations

import pytest

from benchmarks.bench_step_interleaved import (
    COMPILED_ONLY,
    FIELDS,
    INDUCTOR_OPTIONS,
    VARIANTS,
    _line,
    measure,
    ratios,
    summarize,
    variants_for,
)


def test_eager_runs_every_variant_without_inductor_options_or_a_trace_only_setting():
    assert variants_for("eager") == [
        n for n in VARIANTS if n not in INDUCTOR_OPTIONS and n not in COMPILED_ONLY
    ]
    assert "ours_torch_compose" not in variants_for("eager")
    assert "ours_layer_norms" in variants_for("eager")
    assert "ours_stacked" in variants_for("eager")


@pytest.mark.parametrize("mode", ["compile", "reduce-overhead"])
def test_compiled_modes_run_only_variants_without_config_overrides_but_trace_only_ones(mode):
    got = variants_for(mode)
    assert got == ["peft_lora", "ours", "ours_static_launch", "ours_streams", "ours_norm_buffer",
                   "ours_torch_compose", "ours_kernel_compose", "ours_torch_forward",
                   "ours_inference_compose", "ours_norm_buffer_torch_forward", "ours_recompute",
                   "peft_dora"]  # fmt: skip
    assert variants_for(mode, {"peft_lora", "ours", "ours_layer_norms"}) == ["peft_lora", "ours"]


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="mode must be one of"):
        variants_for("jit")


def test_an_unknown_workload_is_refused_by_name():
    with pytest.raises(ValueError, match="workload must be one of"):
        measure(16, "bf16", workload="backward")


def _row(variant, optim, median, mode="eager", batch=1, workload="train"):
    return {"variant": variant, "optim": optim, "step_median_ms": median, "mode": mode,
            "rank": 16, "batch": batch, "adapters": "bf16", "workload": workload}  # fmt: skip


def test_ratios_compare_each_optimizer_with_lora_under_the_same_optimizer():
    rows = [_row("peft_lora", "foreach", 40.0), _row("ours", "foreach", 44.0),
            _row("peft_lora", "fused", 50.0), _row("ours", "fused", 70.0),
            _row("ours_rev", "fused", 55.0), _row("peft_dora", "fused", 80.0),
            _row("ours_stacked", "foreach", 42.0)]  # fmt: skip
    got = {r["metric"]: (round(r["value"], 6), r["ok"]) for r in ratios(rows, "abc1234")}
    assert got == {
        "ours/LoRA train median [r=16 b=1 eager foreach bf16-adapters]": (1.1, True),
        "ours/LoRA train median [r=16 b=1 eager fused bf16-adapters]": (1.4, False),
        "ours@abc1234/LoRA train median [r=16 b=1 eager fused bf16-adapters]": (1.1, True),
        "ours_stacked/LoRA train median [r=16 b=1 eager foreach bf16-adapters]": (1.05, True),
    }
    compiled = ratios([_row("peft_lora", "fused", 40.0, "compile"),
                       _row("ours", "fused", 45.0, "compile")])  # fmt: skip
    assert [(r["target"], r["ok"]) for r in compiled] == [("<= 1.1", False)]
    # batch 4 is GPU-bound: issue 10's eager target there is 1.12, not batch 1's 1.25
    b4 = ratios([_row("peft_lora", "foreach", 100.0, batch=4),
                 _row("ours", "foreach", 115.0, batch=4)])  # fmt: skip
    assert [(r["target"], r["ok"]) for r in b4] == [("<= 1.12", False)]
    assert "b=4" in b4[0]["metric"]


def test_summarize_takes_min_and_median_of_times_and_median_of_gpu_phases():
    samples = [(50.0, 5.0, 4.0, 20.0, 28.0, 3.0), (48.0, 6.0, 3.0, 18.0, 27.0, 2.0),
               (52.0, 7.0, 5.0, 22.0, 30.0, 4.0)]  # fmt: skip
    got = summarize(samples)
    assert got == {
        "step_min_ms": 48.0, "step_median_ms": 50.0, "fwd_host_min_ms": 5.0,
        "fwd_host_median_ms": 6.0, "bwd_host_min_ms": 3.0, "bwd_host_median_ms": 4.0,
        "fwd_gpu_median_ms": 20.0, "bwd_gpu_median_ms": 28.0, "opt_gpu_median_ms": 3.0,
    }  # fmt: skip
    assert set(got) <= set(FIELDS)


def test_inference_rows_are_held_to_the_inference_target():
    rows = [_row("peft_lora", "", 20.0, "compile", workload="infer"),
            _row("ours", "", 20.9, "compile", workload="infer"),
            _row("ours_rev", "", 21.2, "compile", workload="infer")]  # fmt: skip
    got = {r["metric"]: (round(r["value"], 6), r["target"], r["ok"]) for r in ratios(rows, "c1")}
    assert got == {
        "ours/LoRA infer median [r=16 b=1 compile bf16-adapters]": (1.045, "<= 1.05", True),
        "ours@c1/LoRA infer median [r=16 b=1 compile bf16-adapters]": (1.06, "<= 1.05", False),
    }


def test_an_inference_call_has_no_backward_or_optimizer_phase():
    samples = [(20.0, 4.0, None, 19.0, None, None), (22.0, 5.0, None, 21.0, None, None),
               (21.0, 6.0, None, 20.0, None, None)]  # fmt: skip
    got = summarize(samples)
    assert got == {
        "step_min_ms": 20.0, "step_median_ms": 21.0, "fwd_host_min_ms": 4.0,
        "fwd_host_median_ms": 5.0, "fwd_gpu_median_ms": 20.0,
    }  # fmt: skip
    line = _line({"variant": "ours", **got})
    assert "bwd" not in line and "opt" not in line and "GPU fwd  20.00" in line
    train = summarize([(50.0, 5.0, 4.0, 20.0, 28.0, 3.0)])
    assert "bwd host   4.00" in _line({"variant": "ours", **train})


def test_build_overrides_hold_while_the_model_is_built_and_are_restored(monkeypatch):
    """``BUILD_OVERRIDES``: the config a variant's model is accelerated under, and nothing
    after it (the next variant's build, the steps) sees it."""
    from benchmarks import bench_step_interleaved as si
    from dora_torch import config

    seen = []

    def wrap(base, provider, rank):
        seen.append((provider, config.NORM_GROUP_STREAMS, config.COMPILED_TRAIN_NORM))
        if rank < 0:
            raise RuntimeError("build failed")
        return base

    monkeypatch.setattr(si.bm, "build_base", lambda layers: layers)
    monkeypatch.setattr(si.bm, "_wrap", wrap)
    assert si._built("ours_norm_buffer", 8, "ours_bf16", 16) == 8
    with pytest.raises(RuntimeError, match="build failed"):
        si._built("ours_streams", 8, "ours_bf16", -1)
    si._built("ours", 8, "ours_bf16", 16)
    assert seen == [("ours_bf16", 4, "buffer"), ("ours_bf16", 4, "graph"),
                    ("ours_bf16", 1, "graph")]  # fmt: skip
    assert (config.NORM_GROUP_STREAMS, config.COMPILED_TRAIN_NORM) == (1, "graph")


def test_norm_counts_read_one_recomputation_per_layer_and_step_and_none_for_other_models():
    """``norm_counts``, the ``norms_per_layer_step`` column: an eager training step recomputes
    each layer's norm once; a second model's steps (its own optimizer) recompute nothing of
    the first, even in eval mode, where the step hook refreshes norm buffers; a model without
    DoRA layers has no count."""
    import torch
    from torch import nn

    import dora_torch
    from benchmarks.bench_step_interleaved import norm_counts

    def net(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 24), nn.Linear(24, 16))
        dora_torch.inject(model, target_modules=["0", "1"], r=4, lora_alpha=8)
        return model

    trained, other = net(0), net(1).eval()
    assert norm_counts(nn.Linear(3, 3)) == (0, 0)
    x = torch.randn(4, 32)
    with torch.no_grad():
        other(x)  # its eval buffers filled
    opt = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], fused=True)
    start, layers = norm_counts(trained)
    kept = norm_counts(other)
    assert layers == 2
    for _ in range(3):
        opt.zero_grad()
        trained(x).square().mean().backward()
        opt.step()
    assert norm_counts(trained)[0] - start == 3 * layers
    assert norm_counts(other) == kept
    assert "norms_per_layer_step" in FIELDS
    row = {"variant": "ours", **summarize([(50.0, 5.0, 4.0, 20.0, 28.0, 3.0)])}
    assert _line({**row, "norms_per_layer_step": 1.0}).endswith("| norms/layer/step 1.00")
