"""``recompute_inner``: backward recomputes x Wᵀ + s·h Bᵀ instead of keeping a [T, d_out]
tensor for the magnitude gradient (``ops.SAVE_RECOMPUTE``).

What it must do: the same results (forward identical, every gradient within the spec's
tolerance, the ones that do not read inner identical), and keep exactly what a LoRA layer
keeps, which is what ``benchmarks/work_floor.py``'s memory account assumes. The saved tensors
are counted with ``torch.autograd.graph.saved_tensors_hooks`` (by storage, parameters left
out), so the memory claims are checked on CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dora_torch
from dora_torch.interop import dora_layers
from tests.torch.helpers import check_tier, random_case_tensors

CASE_NAMES = ["basic", "odd_shapes", "rank_one", "no_tokens", "zero_base_row", "no_bias"]


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("impl", ["eager", "fused"])
def test_recompute_matches_the_spec(case, impl):
    for dtype in (torch.float32, torch.bfloat16):
        check_tier(case, dtype, impl, recompute_inner=True)


@pytest.mark.parametrize("impl", ["eager", "fused"])
def test_recompute_with_dropout_and_fp16_matches_the_spec(impl):
    check_tier("basic", torch.float32, impl, dropout_p=0.25, recompute_inner=True)
    check_tier("magnitude_perturbed", torch.float16, impl, recompute_inner=True)


def _grads(recompute, impl, dtype, bias, seed=3):
    x, W, A, B, m, b, s = random_case_tensors(seed, d_in=40, d_out=36, r=6, lead=(2, 9))
    leaves = [t.to(dtype).requires_grad_(True) for t in (x, A, B, m)]
    x, A, B, m = leaves
    bias_t = b.to(dtype) if bias else None
    y = dora_torch.dora_linear(
        x, W.to(dtype), A, B, m, s, bias_t, impl=impl, recompute_inner=recompute
    )
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(dtype))
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("impl", ["eager", "fused"])
@pytest.mark.parametrize("bias", [False, True])
def test_recompute_changes_only_the_magnitude_gradient(impl, bias):
    """y, dx, dA and dB do not read inner: bit for bit the default's. The eager tier's dm
    too (it recomputes inner with its forward's rounding, and its default saves that inner);
    the fused tier's dm reads the recomputed inner where the default recovered y / g or stored
    the kernel's rounding, so it is judged against the spec (the tests above)."""
    dtype = torch.bfloat16
    y0, (dx0, dA0, dB0, dm0) = _grads(False, impl, dtype, bias)
    y1, (dx1, dA1, dB1, dm1) = _grads(True, impl, dtype, bias)
    assert torch.equal(y0, y1)
    for name, a, b in (("dx", dx0, dx1), ("dA", dA0, dA1), ("dB", dB0, dB1)):
        assert torch.equal(a, b), name
    if impl == "eager":
        assert torch.equal(dm0, dm1)


# ---------------------------------------------------------------------- what is kept
def _saved_bytes(run, exclude) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes of the distinct storages autograd keeps while ``run()`` builds its graph, leaving
    out the storages of ``exclude`` (parameters, frozen weights); and their shapes."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, tuple[int, tuple[int, ...]]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and ptr not in seen:
            seen[ptr] = (t.untyped_storage().nbytes(), tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(n for n, _ in seen.values()), sorted(shape for _, shape in seen.values())


def _layer_inputs(dtype, tokens=11, d_in=24, d_out=20):
    torch.manual_seed(0)
    lin = nn.Linear(d_in, d_out, bias=False, dtype=dtype)
    x = torch.randn(tokens, d_in, dtype=dtype, requires_grad=True)
    return lin, x


@pytest.mark.parametrize("impl", ["eager", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_keeps_what_a_lora_layer_keeps(impl, dtype):
    """Beyond a LoRA layer's x and h, the default keeps one [T, d_out] tensor (inner, or y,
    which the next op usually keeps too); with recompute_inner it keeps LoRA's tensors plus
    only [d_out] vectors (the norm)."""
    tokens, d_in, d_out, r = 11, 24, 20, 4
    lin, x = _layer_inputs(dtype, tokens, d_in, d_out)
    lora_A = nn.Linear(d_in, r, bias=False, dtype=dtype)
    lora_B = nn.Linear(r, d_out, bias=False, dtype=dtype)
    for p in lin.parameters():
        p.requires_grad_(False)
    lora_bytes, lora_shapes = _saved_bytes(
        lambda: lin(x) + 2.0 * lora_B(lora_A(x)),
        [*lin.parameters(), *lora_A.parameters(), *lora_B.parameters()],
    )
    assert lora_shapes == [(tokens, r), (tokens, d_in)]
    per = {}
    for recompute in (False, True):
        layer = dora_torch.Linear.from_linear(
            lin, r=r, lora_alpha=8, adapter_dtype=dtype, impl=impl, recompute_inner=recompute
        )
        with torch.no_grad():
            layer.lora_B.normal_()
        per[recompute] = _saved_bytes(lambda layer=layer: layer(x), list(layer.parameters()))
    extra = tokens * d_out * dtype.itemsize
    small = [shape for shape in per[True][1] if shape == (d_out,)]
    vectors = sum(d_out * 4 for _ in small)  # fp32 [d_out] (the norm)
    assert per[True][0] == lora_bytes + vectors
    assert per[False][0] == lora_bytes + vectors + extra


def test_recompute_inner_is_validated_and_shown():
    lin = nn.Linear(8, 6)
    with pytest.raises(TypeError, match="recompute_inner"):
        dora_torch.Linear.from_linear(lin, r=2, lora_alpha=4, recompute_inner=1)
    assert lin.weight.requires_grad  # nothing changed by the failed call
    with pytest.raises(TypeError, match="recompute_inner"):
        dora_torch.Linear(8, 6, r=2, lora_alpha=4, recompute_inner="yes")
    x, W, A, B, m, b, s = random_case_tensors(0)
    with pytest.raises(TypeError, match="recompute_inner"):
        dora_torch.dora_linear(x, W, A, B, m, s, b, recompute_inner=None)
    layer = dora_torch.Linear(8, 6, r=2, lora_alpha=4, recompute_inner=True)
    assert "recompute_inner=True" in repr(layer)


# ------------------------------------------------------------------ model selection
def test_inject_selects_the_recomputed_layers_and_fails_atomically():
    from tests.parity.models import tiny_llama

    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="recompute_modules"):
        dora_torch.inject(
            model, target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8,
            recompute_modules=["down_proj"],
        )  # fmt: skip
    assert not dora_layers(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(TypeError, match="recompute_modules"):
        dora_torch.inject(
            model, target_modules=["q_proj"], r=4, lora_alpha=8, recompute_modules=[1]
        )  # fmt: skip
    dora_torch.inject(
        model, target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8,
        recompute_modules=["q_proj"],
    )  # fmt: skip
    flags = {n.rsplit(".", 1)[-1]: m.recompute_inner for n, m in dora_layers(model).items()}
    assert flags == {"q_proj": True, "v_proj": False}


LLAMA_UNKEPT = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]


def _peft_model(use_dora):
    from peft import LoraConfig, get_peft_model

    from tests.parity.models import ALL_PROJ, randomize_dora, tiny_llama

    config = LoraConfig(r=4, lora_alpha=8, use_dora=use_dora, target_modules=ALL_PROJ)
    model = get_peft_model(tiny_llama(), config)
    randomize_dora(model)
    return model.train()


def test_accelerate_peft_recompute_modules_select_and_validate():
    peft_model = _peft_model(True)
    with pytest.raises(ValueError, match="recompute_modules"):
        dora_torch.accelerate_peft(peft_model, impl="fused", recompute_modules=["lm_head"])
    assert not any("_dora_impl" in m.__dict__ for m in peft_model.modules())  # untouched
    dora_torch.accelerate_peft(peft_model, impl="fused", recompute_modules=LLAMA_UNKEPT)
    flags = {
        n.rsplit(".", 1)[-1]: m._dora_recompute_inner
        for n, m in peft_model.named_modules()
        if "_dora_recompute_inner" in m.__dict__
    }
    assert flags == {p: p in LLAMA_UNKEPT for p in flags} and len(flags) == 7
    report = peft_model.dora_acceleration_report
    assert len(report.recomputed) == 5 * 2  # five projections in each of the two layers
    assert "10 recomputing their product in backward" in str(report)
    dora_torch.restore_peft(peft_model)
    assert not any("_dora_recompute_inner" in m.__dict__ for m in peft_model.modules())


def test_llama_keeps_lora_memory_with_the_unkept_outputs_recomputed():
    """The memory account of ``benchmarks/work_floor.py`` on a real transformers Llama:
    accelerated DoRA keeps, beyond PEFT LoRA's tensors, the outputs of q, k, v, o and down
    (gate's and up's are kept by the SwiGLU product anyway), and with those five recomputed
    it keeps LoRA's tensors plus one [d_out] norm per layer; gradients unchanged."""
    from tests.parity.models import tiny_llama_config, token_ids

    ids = token_ids(tiny_llama_config(), batch=2, seq=12)
    results = {}
    for name, use_dora, recompute in (
        ("lora", False, None),
        ("ours", True, None),
        ("recompute", True, LLAMA_UNKEPT),
    ):
        model = _peft_model(use_dora)
        if use_dora:
            dora_torch.accelerate_peft(model, impl="fused", recompute_modules=recompute)
        params = list(model.parameters())
        saved, _ = _saved_bytes(lambda model=model: model(input_ids=ids, labels=ids).loss, params)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results[name] = (saved, loss.detach(), grads, model)
    cfg = results["ours"][3].config
    tokens, layers = 2 * 12, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    unkept = cfg.hidden_size * 3 + 2 * kv  # q, o, down: hidden; k, v: kv
    norms = layers * (3 * cfg.hidden_size + 2 * kv + 2 * cfg.intermediate_size) * 4
    assert results["recompute"][0] == results["lora"][0] + norms
    assert results["ours"][0] == results["lora"][0] + norms + layers * tokens * unkept * 4
    assert torch.equal(results["ours"][1], results["recompute"][1])
    for n, g in results["ours"][2].items():
        torch.testing.assert_close(results["recompute"][2][n], g, rtol=1e-5, atol=1e-6)
