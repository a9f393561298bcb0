"""The arithmetic of ``benchmarks/work_floor.py`` (what exact DoRA must add to LoRA's work)."""

import itertools

import pytest

from benchmarks import work_floor as wf


def test_flop_counts_by_hand():
    # d_in 4, d_out 2, r 1, 3 tokens: every GEMM [m, k] × [k, n] is 2·m·k·n FLOPs.
    layer = wf.Layer(d_in=4, d_out=2, r=1, tokens=3)
    assert layer.lora_forward() == 2 * 3 * 4 * 2 + 2 * 3 * 4 * 1 + 2 * 3 * 1 * 2
    dx = 2 * 3 * 2 * 4  # dy·W
    dh = 2 * 3 * 2 * 1  # dy·B
    dx_lora = 2 * 3 * 1 * 4  # dh·A
    d_b = 2 * 2 * 3 * 1  # dyᵀ·h
    d_a = 2 * 1 * 3 * 4  # dhᵀ·x
    assert layer.lora_backward() == dx + dh + dx_lora + d_b + d_a
    # U = W·Aᵀ; G = A·Aᵀ; (B·G) in the assembly
    assert layer.norm() == 2 * 2 * 4 * 1 + 2 * 1 * 4 * 1 + 2 * 2 * 1 * 1
    assert layer.forward_floor() == pytest.approx((84 + 28) / 84)


def test_floors_fall_towards_one_with_more_tokens():
    floors = [wf.Layer(8192, 8192, 384, t).forward_floor() for t in (512, 4096, 32768)]
    assert floors[0] > floors[1] > floors[2] > 1.0
    assert wf.Layer(8192, 8192, 384, 4096).grad_floor() < floors[1]


def test_time_floor_adds_the_norm_at_the_given_rate():
    # 1e12 FLOPs at 1000 TFLOP/s is 1 ms on top of a 4 ms LoRA call.
    assert wf.time_floor(4.0, 10**12, 1000.0) == pytest.approx(1.25)


def test_the_cited_runs_hold_the_rows_the_floors_need():
    for layer, csv_name, shape in wf.JAX_LAYER_TARGETS:
        ms = wf.measured_ms(csv_name, shape)
        assert {("lora", "fwd"), ("lora", "grad"), ("ours_xla", "fwd")} <= set(ms)
        assert shape == f"{layer.d_in}x{layer.d_out}_r{layer.r}_t{layer.tokens}"


def test_pass_floor_counts_w_once_and_three_activation_passes():
    layer = wf.Layer(d_in=1000, d_out=500, r=2, tokens=10)
    assert wf.pass_bytes(1000, 500, 10) == (1000 * 500 + 3 * 10 * 500) * 2
    # 1 ms of LoRA, bytes at 1 TB/s: at r = 2, U's read of W is slower than its FLOPs
    read_ms, acts_ms = 1000 * 500 * 2 / 1e9, 3 * 10 * 500 * 2 / 1e9
    assert wf.norm_ms(layer, tb_per_s=1.0) == pytest.approx(read_ms)
    assert wf.activation_ms(layer, tb_per_s=1.0) == pytest.approx(acts_ms)
    assert wf.pass_floor(1.0, layer, tb_per_s=1.0) == pytest.approx(1.0 + read_ms + acts_ms)
    # a forward alone has no scale-and-reduce
    assert wf.pass_floor(1.0, layer, tb_per_s=1.0, backward=False) == pytest.approx(1.0 + read_ms)


def test_the_norm_takes_the_slower_of_its_read_and_its_flops_not_their_sum():
    wide = wf.Layer(d_in=8192, d_out=8192, r=384, tokens=0)  # 384 FLOPs per byte of W
    flops_ms = wide.norm() / (wf.GEMM_TFLOPS * 1e9)
    read_ms = 8192 * 8192 * 2 / (wf.COPY_TB_PER_S * 1e9)
    assert flops_ms > read_ms
    assert wf.norm_ms(wide) == pytest.approx(flops_ms)
    narrow = wf.Layer(d_in=8192, d_out=8192, r=16, tokens=0)
    assert wf.norm_ms(narrow) == pytest.approx(read_ms)


def test_pass_floor_over_several_layers_adds_each_layers_work():
    a, b = wf.Layer(100, 50, 2, 10), wf.Layer(50, 200, 2, 10)
    one = wf.pass_floor(1.0, a, tb_per_s=1.0) - 1.0
    two = wf.pass_floor(1.0, b, tb_per_s=1.0) - 1.0
    assert wf.pass_floor(1.0, a, b, tb_per_s=1.0) == pytest.approx(1.0 + one + two)


def test_the_model_is_eight_llama_layers_of_seven_projections():
    layers = wf.model_layers(16, tokens=2048)
    assert len(layers) == 56 and sum(x.d_out for x in layers) == 8 * 43008
    assert wf.model_norm_flops(16) == sum(x.norm() for x in layers)


def test_the_cited_compiled_runs_hold_both_rows():
    for r, csv_name in wf.TORCH_COMPILED_TARGETS:
        assert wf.model_train_ms(csv_name, "ours_bf16", r) > wf.model_train_ms(
            csv_name, "peft_lora_bf16", r
        )
    with pytest.raises(KeyError, match="no ours_bf16"):
        wf.model_train_ms("model_torch_run52.csv", "ours_bf16", 16)


def test_the_cited_jax_model_run_holds_lora_and_ours_at_both_ranks():
    for r, csv_name in wf.JAX_MODEL_TARGETS:
        lora = wf.jax_model_train_ms(csv_name, "jnp_lora", r)
        assert wf.jax_model_train_ms(csv_name, "ours_bf16", r) > lora
        assert wf.pass_floor(lora, *wf.model_layers(r, tokens=2048)) > 1.0
    assert wf.jax_model_train_ms("model_jax_run103.csv", "jnp_dora_naive", 16) > 0
    # a row with the back-to-back rounds is read from them, an older one from train_ms
    assert wf.jax_model_train_ms("model_jax_run133.csv", "jnp_lora", 16) == pytest.approx(
        46.8798049, rel=1e-6
    )
    assert wf.jax_model_train_ms("model_jax_run103.csv", "jnp_lora", 16) == pytest.approx(
        47.71, abs=0.01
    )
    with pytest.raises(KeyError, match="no jnp_lora r=7"):
        wf.jax_model_train_ms("model_jax_run103.csv", "jnp_lora", 7)


def test_naive_bound_is_the_speedup_at_the_floor():
    # naive 12 ms, LoRA 10 ms, ours at best 1.2 × LoRA = 12 ms: naive can be at most 1.0×.
    assert wf.naive_bound(12.0, 10.0, 1.2) == pytest.approx(1.0)


def test_kept_bytes_are_the_unkept_outputs_and_recomputing_frees_them():
    # per token and layer: q 4096 + k 1024 + v 1024 + o 4096 + down 4096 outputs, bf16
    assert wf.kept_bytes(tokens=1, layers=1) == (4096 + 1024 + 1024 + 4096 + 4096) * 2
    # run 80's batch-4 gap (15.93 - 14.18 GiB) is this to the MiB: 8 layers x 8192 tokens
    assert wf.kept_bytes(8192) / wf.GIB == pytest.approx(1.75)
    assert wf.kept_bytes(8192, recomputed=wf.LLAMA_UNKEPT) == 0
    assert wf.kept_bytes(1, 1, recomputed=("down_proj",)) == (4096 + 1024 + 1024 + 4096) * 2
    assert wf.recompute_flops(3, ("k_proj",), layers=2) == 2 * (2 * 3 * 4096 * 1024)


def test_cheapest_recompute_meets_the_target_for_the_fewest_flops():
    lora = 14.0
    names, flops = wf.cheapest_recompute(lora, 1.05, tokens=8192)
    peak = lora + wf.kept_bytes(8192, recomputed=names) / wf.GIB
    assert peak <= 1.05 * lora
    for k in range(len(wf.LLAMA_UNKEPT) + 1):  # no cheaper subset meets it
        for other in itertools.combinations(wf.LLAMA_UNKEPT, k):
            if lora + wf.kept_bytes(8192, recomputed=other) / wf.GIB <= 1.05 * lora:
                assert wf.recompute_flops(8192, other) >= flops
    assert wf.cheapest_recompute(lora, 1.5, tokens=8192) == ((), 0)  # nothing needed
    assert wf.cheapest_recompute(lora, 0.99, tokens=8192) is None  # below LoRA itself


def test_the_memory_target_run_has_its_rows():
    r, batch, csv_name = wf.TORCH_MEMORY_TARGET
    lora = wf.model_peak_gib(csv_name, "peft_lora_bf16", r, batch)
    ours = wf.model_peak_gib(csv_name, "ours_bf16", r, batch)
    assert ours - lora == pytest.approx(wf.kept_bytes(batch * 2048) / wf.GIB, abs=0.01)


def test_the_measured_kernel_floor_reads_its_cited_runs():
    """The reduce-overhead r = 384 floor from measured kernels: the cited files hold the rows
    it needs, and the floor is LoRA's step plus those kernel times."""
    runs = wf.MEASURED_FLOOR_RUNS
    steps = wf.step_medians(runs["step"])
    assert {"peft_lora", "ours"} <= set(steps)
    gemms = wf.norm_gemms_ms(runs["norm_gemms"])
    assert gemms == {"U": 2.418, "G": 0.724}  # run 63's per-step lines
    copy = wf.assembly_copy_ms(runs["assembly_copy"])
    assert 0.3 < copy < 0.5  # 16 · 4.8 + 24 · 4.8 + 16 · 11.5 µs in run 160
    assert wf.measured_kernel_floor(40.0, 3.0, 1.0) == pytest.approx(1.1)
    floor = wf.measured_kernel_floor(steps["peft_lora"], gemms["U"] + gemms["G"], copy)
    assert 1.0 < floor < steps["ours"] / steps["peft_lora"]
