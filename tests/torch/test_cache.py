"""The norm cache is never read stale (docs/design.md §8): after every optimizer step of every
optimizer kind, load_state_dict, merges and mode switches, a module's output equals a fresh,
uncached computation — for dora_torch.Linear and for PEFT layers under accelerate_peft."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dora_torch
from dora_torch.cache import optimizer_steps

from .helpers import uncached_output


def _adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=0.05, relative_step=False, scale_parameter=False)


OPTIMIZERS = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.05, foreach=True),
    "adamw_for_loop": lambda p: torch.optim.AdamW(p, lr=0.05, foreach=False),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.5, fused=True),
    "adafactor": _adafactor,
}


def _layer(seed=0):
    torch.manual_seed(seed)
    return dora_torch.Linear.from_linear(nn.Linear(32, 16), r=4, lora_alpha=8, impl="eager")


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_every_optimizer_step_invalidates_the_norm(kind):
    layer = _layer()
    opt = OPTIMIZERS[kind]([p for p in layer.parameters() if p.requires_grad])
    x = torch.randn(8, 32)
    for _ in range(3):
        opt.zero_grad()
        layer(x).pow(2).mean().backward()
        opt.step()
        y = layer(x)
        torch.testing.assert_close(y, uncached_output(layer, x), rtol=0, atol=0)


def test_the_issue_repro_with_fused_adamw_is_exact():
    layer = _layer()
    opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=0.1, fused=True)
    x = torch.randn(8, 32)
    for _ in range(3):
        opt.zero_grad()
        layer(x).pow(2).mean().backward()
        opt.step()
    y1 = layer(x)
    dora_torch.clear_caches(layer)
    assert (y1 - layer(x)).abs().max().item() == 0.0


def test_gradient_accumulation_pays_for_the_norm_once_per_step():
    layer = _layer()
    opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=0.1, fused=True)
    cache = layer._dora_norm_cache
    for _ in range(2):
        before = cache.norm_computations
        opt.zero_grad()
        for _ in range(4):  # micro-batches: the parameters do not change in between
            layer(torch.randn(3, 32)).sum().backward()
        assert cache.norm_computations == before + 1
        steps = optimizer_steps()
        opt.step()
        assert optimizer_steps() == steps + 1


def test_load_state_dict_merge_and_mode_switches_invalidate():
    layer, other = _layer(0), _layer(1)
    with torch.no_grad():
        other.lora_B.normal_(0, 0.5)
    x = torch.randn(5, 32)
    layer(x)
    layer.load_state_dict(other.state_dict())
    torch.testing.assert_close(layer(x), uncached_output(layer, x), rtol=0, atol=0)
    layer.eval()
    y_eval = layer(x)
    torch.testing.assert_close(y_eval, uncached_output(layer, x), rtol=0, atol=0)
    torch.testing.assert_close(layer.dora_norm, layer.norm(impl="eager"), rtol=0, atol=0)
    layer.merge()
    torch.testing.assert_close(layer(x), y_eval, rtol=1e-5, atol=1e-5)
    layer.unmerge()
    torch.testing.assert_close(layer(x), uncached_output(layer, x), rtol=0, atol=0)
    torch.testing.assert_close(layer.dora_norm, layer.norm(impl="eager"), rtol=1e-6, atol=1e-6)
    layer.train()
    torch.testing.assert_close(layer(x), uncached_output(layer, x), rtol=0, atol=0)


def test_eval_mode_buffer_follows_optimizer_steps():
    """An eval-mode module's norm buffer (what compiled graphs read) is refreshed by the
    optimizer step itself, before any forward runs."""
    layer = _layer()
    opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=0.1, fused=True)
    layer.eval()  # e.g. training without dropout in eval mode
    x = torch.randn(4, 32)
    for _ in range(2):
        opt.zero_grad()
        layer(x).square().mean().backward()
        opt.step()
        with torch.no_grad():
            want = dora_torch.factored_norm(
                layer.weight, layer.lora_A, layer.lora_B, layer.scaling, impl="eager"
            )
        torch.testing.assert_close(layer.dora_norm, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["adamw_fused", "adafactor"])
def test_accelerated_peft_layers_follow_every_step(kind):
    from tests.parity.models import peft_dora, tiny_llama, token_ids

    model = peft_dora(tiny_llama(), target_modules=("q_proj", "v_proj", "down_proj"))
    dora_torch.accelerate_peft(model, impl="eager")
    model.train()
    ids = token_ids(model.config)
    opt = OPTIMIZERS[kind]([p for p in model.parameters() if p.requires_grad])
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        with torch.no_grad():
            y = model(input_ids=ids).logits
            layers = [m for m in model.modules() if hasattr(m, "_dora_norm_cache")]
            assert layers and all(m.last_impl == "eager" for m in layers)
            dora_torch.restore_peft(model)
            want = model(input_ids=ids).logits
            dora_torch.accelerate_peft(model, impl="eager")
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_modules_built_under_inference_mode_work_and_are_never_stale():
    """Parameters created under ``torch.inference_mode`` are inference tensors, which have no
    version counter: such a module computes its norm in every call (an in-place write to them
    could not be seen otherwise), in training and eval mode, plain or grouped."""
    from dora_torch.interop.inject import dora_layers, inject

    x = torch.randn(3, 32)
    with torch.inference_mode():
        layer = _layer()
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
        inject(model, target_modules=["0", "1"], r=4, lora_alpha=8)
        grouped = list(dora_layers(model).values())
        layer.lora_B.normal_(0, 0.3)
        for module in grouped:  # the group computes the fused tier only (Triton interpreter)
            module.impl = "fused"
            module.lora_B.normal_(0, 0.3)
        for mode in (True, False):
            layer.train(mode)
            computed = layer._dora_norm_cache.norm_computations
            torch.testing.assert_close(layer(x), uncached_output(layer, x), rtol=0, atol=0)
            layer.lora_B.mul_(1.5)  # no version counter: only recomputing sees this
            torch.testing.assert_close(layer(x), uncached_output(layer, x), rtol=0, atol=0)
            assert layer._dora_norm_cache.norm_computations == computed + 2
        before = [m._dora_norm_cache.norm_computations for m in grouped]
        want = uncached_output(
            grouped[1], uncached_output(grouped[0], x, impl="fused"), impl="fused"
        )
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
        # each layer computed its own norm once, not the whole group in every layer's call
        assert [m._dora_norm_cache.norm_computations for m in grouped] == [n + 1 for n in before]


def test_accelerated_peft_model_built_under_inference_mode():
    from tests.parity.models import peft_dora, tiny_llama, token_ids

    with torch.inference_mode():
        model = peft_dora(tiny_llama(), target_modules=("q_proj", "v_proj", "down_proj"))
        model.eval()
        ids = token_ids(model.config)
        want = model(input_ids=ids).logits
        dora_torch.accelerate_peft(model, impl="eager")
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
