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


def _fresh_norm(layer):
    """The norm of ``layer``'s tensors now, computed without its cache."""
    with torch.no_grad():
        return dora_torch.factored_norm(
            layer.weight, layer.lora_A, layer.lora_B, layer.scaling, impl="eager"
        )


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
        torch.testing.assert_close(layer.dora_norm, _fresh_norm(layer), rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_step_refreshes_the_buffers_of_the_modules_its_optimizer_holds_only(kind):
    """Another model in eval mode (a reference or teacher model) keeps its norm buffer
    through the trained model's steps, which compute nothing for it; the trained one's follows
    every step; an optimizer of the magnitude alone changes no norm and computes none. (An
    eager call of the other model still recomputes its norm once after any step: its entry
    holds the process-wide step count, rule 2.)"""
    trained, reference = _layer(0), _layer(1)
    for layer in (trained, reference):
        layer.eval()
        with torch.no_grad():
            layer.lora_B.normal_(0, 0.5)
        dora_torch.clear_caches(layer)
    opt = OPTIMIZERS[kind]([p for p in trained.parameters() if p.requires_grad])
    magnitude_only = OPTIMIZERS[kind]([reference.lora_magnitude_vector])
    x = torch.randn(4, 32)
    kept = reference.dora_norm.clone()
    cache = reference._dora_norm_cache
    for _ in range(2):
        opt.zero_grad()
        trained(x).square().mean().backward()
        counts = cache.norm_computations
        opt.step()
        assert cache.norm_computations == counts
        torch.testing.assert_close(trained.dora_norm, _fresh_norm(trained), rtol=0, atol=0)
        magnitude_only.zero_grad()
        reference(x).square().mean().backward()
        counts = cache.norm_computations
        magnitude_only.step()
        assert cache.norm_computations == counts
    torch.testing.assert_close(reference.dora_norm, kept, rtol=0, atol=0)
    torch.testing.assert_close(reference.dora_norm, _fresh_norm(reference), rtol=0, atol=0)
    # an optimizer that holds the reference's B does refresh it, at its step
    both = OPTIMIZERS[kind]([reference.lora_B])
    both.zero_grad()
    reference(x).square().mean().backward()
    both.step()
    assert not torch.equal(reference.dora_norm, kept)
    torch.testing.assert_close(reference.dora_norm, _fresh_norm(reference), rtol=0, atol=0)


def test_a_norm_group_is_refreshed_by_the_steps_of_its_own_model_only():
    """Two injected models in eval mode, two norm groups: stepping one model's optimizer
    recomputes its group's members and none of the other's."""
    from dora_torch.interop.inject import dora_layers

    def net(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 24), nn.Linear(24, 16))
        dora_torch.inject(model, target_modules=["0", "1"], r=4, lora_alpha=8)
        return model.eval()

    trained, reference = net(0), net(1)
    layers = {name: list(dora_layers(m).values()) for name, m in
              (("trained", trained), ("reference", reference))}  # fmt: skip
    assert layers["trained"][0]._dora_norm_cache.group is not None
    opt = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], fused=True)
    x = torch.randn(4, 32)

    def counts(name):
        return [m._dora_norm_cache.norm_computations for m in layers[name]]

    opt.zero_grad()
    trained(x).square().mean().backward()
    before = {name: counts(name) for name in layers}
    opt.step()
    assert counts("reference") == before["reference"]
    assert all(a > b for a, b in zip(counts("trained"), before["trained"], strict=True))
    for m in layers["trained"]:
        torch.testing.assert_close(m.dora_norm, _fresh_norm(m), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_pickled_and_copied_models_keep_their_caches_honest(how, tmp_path):
    """A whole model saved with ``torch.save`` (or deep-copied) after training: its caches
    come back empty, its layers group with each other (not with the original's), the step
    hook follows them, and training on goes exactly as on the original."""
    import copy

    from dora_torch.cache import module_cache
    from dora_torch.interop import dora_layers
    from tests.parity.models import tiny_llama, token_ids

    model = dora_torch.inject(
        tiny_llama(), target_modules=["q_proj", "v_proj", "down_proj"], r=4, lora_alpha=8
    ).train()
    ids = token_ids(model.config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        torch.save(model, tmp_path / "model.pt")
        twin = torch.load(tmp_path / "model.pt", weights_only=False)
    layers = list(dora_layers(twin).values())
    group = module_cache(layers[0]).group
    assert group is not None and {id(m) for m in layers} == {
        id(ref()) for ref in group._members
    }  # the twin's own layers
    twin.eval()  # the step hook must refresh the twin's eval buffers from here on
    twin_opt = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=0.05)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # state tensors are shared
    model.eval()
    for net, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        net(input_ids=ids, labels=ids).loss.backward()
        o.step()
    for a, b in zip(dora_layers(model).values(), layers, strict=True):
        torch.testing.assert_close(b.dora_norm, a.dora_norm, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(twin(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_pickled_accelerated_peft_model_follows_optimizer_steps(tmp_path):
    """``torch.save`` / ``torch.load`` of a whole accelerated PEFT model: its layers' eval
    buffers (what compiled graphs read) are refreshed by the next optimizer step."""
    from dora_torch.cache import module_cache
    from tests.parity.models import peft_dora, tiny_llama, token_ids

    model = peft_dora(tiny_llama(), target_modules=("q_proj", "v_proj"))
    dora_torch.accelerate_peft(model, impl="eager")
    ids = token_ids(model.config)
    model(input_ids=ids)  # caches filled
    torch.save(model, tmp_path / "model.pt")
    twin = torch.load(tmp_path / "model.pt", weights_only=False).eval()
    layers = [m for m in twin.modules() if module_cache(m) is not None]
    assert len(layers) == 4
    opt = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=0.1, fused=True)
    opt.zero_grad()
    twin(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for m in layers:
        w, a, b = m.base_layer.weight, m.lora_A["default"].weight, m.lora_B["default"].weight
        with torch.no_grad():
            want = dora_torch.factored_norm(w, a, b, m.scaling["default"], impl="eager")
        torch.testing.assert_close(m.dora_norm, want, rtol=0, atol=0)


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
