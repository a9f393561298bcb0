"""Parity with Hugging Face PEFT's own DoRA: same weights → same output and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dora_torch
import shared_spec as S
from shared_spec.tolerances import assert_close

from .helpers import dense_baseline

peft = pytest.importorskip("peft")


def _pair(
    d_in,
    d_out,
    r,
    *,
    alpha,
    rslora=False,
    bias=True,
    dropout=0.0,
    dtype=torch.float32,
    adapter_fp32=True,
    impl="eager",
    seed=0,
):
    """A PEFT DoRA layer and a dora_torch.Linear with identical (non-trivial) weights."""
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(d_in, d_out, bias=bias)).to(dtype)
    ours = dora_torch.Linear.from_linear(
        copy.deepcopy(base[0]),
        r=r,
        lora_alpha=alpha,
        use_rslora=rslora,
        lora_dropout=dropout,
        adapter_dtype=torch.float32 if adapter_fp32 else dtype,
        impl=impl,
    )
    cfg = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        use_rslora=rslora,
        lora_dropout=dropout,
        use_dora=True,
        target_modules=["0"],
    )
    model = peft.get_peft_model(base, cfg, autocast_adapter_dtype=adapter_fp32)
    layer = model.base_model.model[0]
    with torch.no_grad():
        # Trained-looking adapter: B ≠ 0 and m away from the norm.
        ours.lora_B.normal_(0, 0.5 / (ours.scaling * r**0.5))
        ours.lora_magnitude_vector.mul_(1 + 0.2 * torch.randn(d_out))
        layer.lora_A["default"].weight.copy_(ours.lora_A)
        layer.lora_B["default"].weight.copy_(ours.lora_B)
        layer.lora_magnitude_vector["default"].weight.copy_(ours.lora_magnitude_vector)
    assert layer.scaling["default"] == pytest.approx(ours.scaling)
    return model, layer, ours


def _grads(module, params, x, dy, seed):
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = module(x)
    y.backward(dy)
    return y.detach(), [x.grad, *(p.grad.clone() for p in params)]


CONFIGS = {
    "plain": {},
    "rslora": {"rslora": True, "alpha": 8.0},
    "no_bias": {"bias": False},
    "dropout": {"dropout": 0.25},
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("impl", ["eager", "fused"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_matches_peft_fp32(cfg, impl, train):
    kw = {"alpha": 16.0} | CONFIGS[cfg]
    model, layer, ours = _pair(40, 36, 8, impl=impl, **kw)
    model.train(train)
    ours.train(train)
    x = torch.randn(3, 5, 40)
    dy = torch.randn(3, 5, 36)
    p_peft = [
        layer.lora_A["default"].weight,
        layer.lora_B["default"].weight,
        layer.lora_magnitude_vector["default"].weight,
    ]
    p_ours = [ours.lora_A, ours.lora_B, ours.lora_magnitude_vector]
    y_ref, g_ref = _grads(model, p_peft, x, dy, seed=7)
    y, g = _grads(ours, p_ours, x, dy, seed=7)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(["x", "A", "B", "m"], g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert ours.last_impl == impl


@pytest.mark.parametrize("adapter_fp32", [True, False], ids=["fp32-adapters", "bf16-adapters"])
@pytest.mark.parametrize("impl", ["eager", "fused"])
def test_matches_peft_bf16(impl, adapter_fp32):
    """bf16 activations, judged against the float64 spec. Baseline: PEFT itself with bf16
    adapters; with fp32 adapters PEFT runs the whole adapter path in fp32 while our policy runs
    the adapter products in bf16 (fp32 accumulation), so the baseline is then plain dense DoRA
    in bf16 (ours must still be within 2× of it; PEFT-fp32's own error is far lower)."""
    model, layer, ours = _pair(
        48, 40, 8, alpha=16.0, dtype=torch.bfloat16, impl=impl, adapter_fp32=adapter_fp32
    )
    x = torch.randn(12, 48).to(torch.bfloat16)
    dy = torch.randn(12, 40).to(torch.bfloat16)
    p_peft = [
        layer.lora_A["default"].weight,
        layer.lora_B["default"].weight,
        layer.lora_magnitude_vector["default"].weight,
    ]
    p_ours = [ours.lora_A, ours.lora_B, ours.lora_magnitude_vector]
    y_ref, g_ref = _grads(model, p_peft, x, dy, seed=0)
    y, g = _grads(ours, p_ours, x, dy, seed=0)

    def f64(t):
        return t.detach().double().numpy()

    W, b = f64(ours.weight), f64(ours.bias)
    A, B, m = (f64(p) for p in p_ours)
    spec_y = S.dora_linear(f64(x), W, A, B, m, ours.scaling, b)
    spec = S.dora_linear_vjp(f64(x), W, A, B, m, ours.scaling, f64(dy), b)
    eps = torch.finfo(torch.bfloat16).eps
    if adapter_fp32:
        leaves = [p.detach().to(torch.bfloat16).requires_grad_(True) for p in p_ours]
        xx = x.clone().requires_grad_(True)
        y_ref = dense_baseline(xx, ours.weight, *leaves, ours.scaling, ours.bias)
        y_ref.backward(dy)
        g_ref = [xx.grad, *(p.grad for p in leaves)]
    assert_close(f64(y), spec_y, f64(y_ref), machine_eps=eps, name="y")
    for name, a, r, base in zip(
        ["x", "A", "B", "m"], g, [spec.dx, spec.dA, spec.dB, spec.dm], g_ref
    ):
        assert a.dtype == (torch.float32 if adapter_fp32 and name != "x" else torch.bfloat16)
        assert_close(f64(a), r, f64(base), machine_eps=eps, name=name)


def test_fresh_layer_matches_peft_init_and_base():
    """PEFT-style init: m = ‖W‖_row, B = 0 → output equals the base layer."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 24)
    ours = dora_torch.Linear.from_linear(lin, r=4, lora_alpha=8)
    model = peft.get_peft_model(
        nn.Sequential(copy.deepcopy(lin)),
        peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["0"]),
    )
    m_peft = model.base_model.model[0].lora_magnitude_vector["default"].weight
    torch.testing.assert_close(ours.lora_magnitude_vector.detach(), m_peft.detach())
    assert torch.count_nonzero(ours.lora_B) == 0
    x = torch.randn(5, 32)
    torch.testing.assert_close(ours(x), lin(x), rtol=1e-6, atol=1e-6)
    # kaiming-uniform(a=√5) bound = 1/sqrt(fan_in)
    assert ours.lora_A.abs().max() <= 1 / 32**0.5 + 1e-7
