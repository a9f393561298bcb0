"""dora_torch interop: accelerate_peft / restore_peft, inject, save_adapter / load_adapter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dora_torch
from dora_torch import config
from dora_torch.interop.adapter_io import load_adapter, save_adapter
from dora_torch.interop.inject import dora_layers, inject
from dora_torch.interop.peft_accel import accelerate_peft, restore_peft
from shared_spec import peft_format as pf
from tests.parity.models import ALL_PROJ, peft_dora, randomize_dora, tiny_llama, token_ids

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    (logits.float().square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_grads_close(got, want, rtol):
    assert got.keys() == want.keys() and got
    for name in want:
        err = (got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30)
        assert err <= rtol, f"{name}: rel err {err:.3g}"


# ------------------------------------------------------------------------------ accelerate


def _assert_ours_ran(model, tiers=("eager", "fused")):
    """Every accelerated layer took dora_torch's path on its last call (not PEFT's)."""
    layers = [m for m in model.modules() if hasattr(m, "_dora_norm_cache")]
    assert layers
    for m in layers:
        assert m.last_impl in tiers, m.last_impl


@pytest.mark.parametrize("impl", ["auto", "fused"])
def test_accelerate_peft_matches_peft_outputs_and_grads(impl):
    # The fused tier runs on CUDA, or on CPU through the Triton interpreter (CPU CI).
    device = "cuda" if impl == "fused" and not config.interpreting() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("impl='fused' needs CUDA or the Triton interpreter")
    pm = peft_dora(tiny_llama(), target_modules=[*ALL_PROJ, "lm_head", "embed_tokens"])
    pm.to(device)
    ids = token_ids(pm.base_model.model.config).to(device)
    want_y, want_g = _loss_and_grads(pm, ids)
    with pytest.warns(RuntimeWarning, match="embed_tokens"):
        assert accelerate_peft(pm, impl=impl) is pm
    report = pm.dora_acceleration_report
    assert len(report.accelerated) == 2 * 7 + 1
    assert list(report.skipped) == ["base_model.model.model.embed_tokens"]
    got_y, got_g = _loss_and_grads(pm, ids)
    _assert_ours_ran(pm, ("fused",) if impl == "fused" else ("eager",))
    torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)
    _assert_grads_close(got_g, want_g, rtol=1e-5)
    # The norm is cached per layer: a second call with unchanged weights reuses it.
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    cache = layer._dora_norm_cache
    before = cache.norm_computations
    with torch.no_grad():
        pm(ids)
    assert cache.norm_computations == before
    restore_peft(pm)
    assert "forward" not in vars(layer) and not hasattr(pm, "dora_acceleration_report")
    assert torch.equal(_loss_and_grads(pm, ids)[0], want_y)


def test_accelerated_layer_reads_a_parametrized_base_weight():
    """The fast path reads weights from ``_parameters``; a parametrized W lives elsewhere
    (``parametrizations.weight.original``), and must still be the W the layer computes with,
    after it changes too."""
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2.0 * w

    pm = peft_dora(tiny_llama(), target_modules=["q_proj"])
    ids = token_ids(pm.base_model.model.config)
    base = pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    parametrize.register_parametrization(base, "weight", Doubled())
    want_y, want_g = _loss_and_grads(pm, ids)
    accelerate_peft(pm)
    got_y, got_g = _loss_and_grads(pm, ids)
    _assert_ours_ran(pm, ("eager",))
    torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)
    _assert_grads_close(got_g, want_g, rtol=1e-5)
    with torch.no_grad():  # W changes through its original: the norm follows
        base.parametrizations.weight.original.mul_(0.5)
    restore_peft(pm)
    want_y = _loss_and_grads(pm, ids)[0]
    accelerate_peft(pm)
    torch.testing.assert_close(_loss_and_grads(pm, ids)[0], want_y, rtol=1e-5, atol=1e-6)


def test_accelerated_model_under_activation_checkpointing_matches_peft():
    """transformers' activation checkpointing (non-reentrant) re-runs each decoder layer in
    backward: the recomputed forward must read the same cached norm. Over three AdamW steps
    (each after a cache-invalidating update) the checkpointed model's loss and adapter
    gradients equal, bit for bit, those of the same model without checkpointing and those
    computed again after ``clear_caches``; before any update they match PEFT's to 1e-5.

    After an update the comparison with PEFT is not a test of the cache: AdamW's first steps
    move every element by about ±lr whatever the size of its gradient, so an element whose
    gradient is near zero steps either way on float32 rounding (PEFT's own float32 run drifts
    from float64 by ~5e-6 in the gradients after one step, ours by ~1e-5, varying with the
    library versions)."""
    models = []
    for checkpointing in (True, False):
        pm = peft_dora(tiny_llama(), target_modules=ALL_PROJ)
        randomize_dora(pm)
        accelerate_peft(pm)
        if checkpointing:
            pm.base_model.model.gradient_checkpointing_enable({"use_reentrant": False})
        pm.train()
        models.append(pm)
    peft_model = peft_dora(tiny_llama(), target_modules=ALL_PROJ)
    randomize_dora(peft_model)
    peft_model.train()
    ids = token_ids(peft_model.base_model.model.config)
    (got_y, got_g), _, (want_y, want_g) = (_loss_and_grads(m, ids) for m in (*models, peft_model))
    torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)
    _assert_grads_close(got_g, want_g, rtol=1e-5)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in models]  # fmt: skip
    for _ in range(3):
        for opt in opts:
            opt.step()
        (got_y, got_g), (plain_y, plain_g) = (_loss_and_grads(m, ids) for m in models)
        dora_torch.clear_caches(models[0])
        fresh_y, fresh_g = _loss_and_grads(models[0], ids)
        for want_y, want_g in ((plain_y, plain_g), (fresh_y, fresh_g)):
            assert torch.equal(got_y, want_y)
            assert got_g.keys() == want_g.keys()
            assert all(torch.equal(got_g[n], want_g[n]) for n in want_g)
    _assert_ours_ran(models[0], ("eager",))


@pytest.mark.parametrize("impl", ["auto", "fused"])
def test_switching_adapters_follows_peft_through_training(impl):
    """Two DoRA adapters on one PEFT model, switched with ``set_adapter`` between SGD steps
    (PEFT then trains only the active one): right after each switch and after each step the
    accelerated model's logits are PEFT's. With the fused tier the norm group serves every
    call: a switch must make it look at its members again, and the adapter switched away
    from, trained two steps ago, must not come back with its old norms."""
    from peft import LoraConfig

    device = "cuda" if impl == "fused" and not config.interpreting() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("impl='fused' needs CUDA or the Triton interpreter")

    def build():
        pm = peft_dora(tiny_llama(), target_modules=ALL_PROJ)
        cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=ALL_PROJ)
        pm.add_adapter("other", cfg)
        randomize_dora(pm, seed=1)
        return pm.to(device).train()

    ours, ref = build(), build()
    accelerate_peft(ours, impl=impl)
    ids = token_ids(ref.base_model.model.config).to(device)

    def logits(m):
        with torch.no_grad():
            return m(ids).logits

    for adapter, steps in (("default", 2), ("other", 2), ("default", 1)):
        for m in (ours, ref):
            m.set_adapter(adapter)
        torch.testing.assert_close(logits(ours), logits(ref), rtol=1e-5, atol=1e-6)
        opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05)
                for m in (ours, ref)]  # fmt: skip
        for _ in range(steps):
            for m, opt in zip((ours, ref), opts, strict=True):
                opt.zero_grad()
                m(ids).logits.float().square().mean().backward()
                opt.step()
            torch.testing.assert_close(logits(ours), logits(ref), rtol=1e-5, atol=1e-6)
    _assert_ours_ran(ours, ("fused",) if impl == "fused" else ("eager", "fused"))


@pytest.mark.parametrize("where", ["eval", "train_buffer"])
def test_compiled_graphs_reading_the_norm_buffer_follow_adapter_switches(monkeypatch, where):
    """A compiled graph that reads the layers' norm buffers (eval mode; training mode with
    ``COMPILED_TRAIN_NORM = "buffer"``) gives PEFT's logits right after ``set_adapter``, after
    the adapters are disabled and enabled again, and after the active adapter is deleted. The
    module keeps one buffer: before the switch refreshed it, a graph guarded on the new
    adapter read the norm of the one before (0.095 off in the logits). After a merge and
    unmerge (W written back, not bit for bit) it gives the eager call's logits exactly."""
    from peft import LoraConfig

    monkeypatch.setattr(config, "COMPILED_TRAIN_NORM", "buffer" if where != "eval" else "graph")
    torch._dynamo.reset()

    def build():
        pm = peft_dora(tiny_llama(), target_modules=ALL_PROJ)
        pm.add_adapter("other", LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                           target_modules=ALL_PROJ))  # fmt: skip
        randomize_dora(pm, seed=1)
        return pm.train(where != "eval")

    ours, ref = build(), build()
    accelerate_peft(ours, impl="eager")
    ids = token_ids(ref.base_model.model.config)
    compiled = torch.compile(ours, backend="aot_eager")

    def check():
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids).logits, ref(ids).logits,
                                       rtol=1e-5, atol=1e-6)  # fmt: skip

    check()
    for m in (ours, ref):
        m.set_adapter("other")
    check()
    with ours.disable_adapter(), ref.disable_adapter():
        check()
    check()
    for m in (ours, ref):
        m.delete_adapter("other")  # the active one: PEFT makes "default" active again
    check()
    with torch.no_grad():
        ours.merge_adapter()
        ours.unmerge_adapter()
        got = compiled(ids).logits  # before any eager call could refresh the buffers
        assert torch.equal(got, ours(ids).logits)


def test_training_steps_and_save_pretrained_after_acceleration(tmp_path):
    from peft import PeftModel

    ref = peft_dora(tiny_llama(), target_modules=ALL_PROJ, lora_dropout=0.1).train()
    ours = accelerate_peft(copy.deepcopy(ref))
    ids = token_ids(ref.base_model.model.config)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (ref, ours)]  # fmt: skip
    for _ in range(3):
        losses = []
        for m, opt in zip((ref, ours), opts):
            torch.manual_seed(7)  # the same dropout masks for both
            opt.zero_grad()
            loss = m(ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        _assert_ours_ran(ours)
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (n, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=n)
    ours.eval().save_pretrained(tmp_path / "a")
    back = PeftModel.from_pretrained(tiny_llama(), tmp_path / "a").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-6)


def test_states_peft_handles_itself_fall_back_to_peft():
    pm = peft_dora(tiny_llama(), target_modules=["q_proj", "down_proj"])
    ids = token_ids(pm.base_model.model.config)
    accelerate_peft(pm)
    with torch.no_grad():
        with pm.disable_adapter():
            base = pm(ids).logits
        assert torch.equal(base, tiny_llama()(ids).logits)
        _assert_ours_ran(pm, ("peft",))
        adapted = pm(ids).logits
        _assert_ours_ran(pm)
        pm.merge_adapter()
        torch.testing.assert_close(pm(ids).logits, adapted, rtol=1e-5, atol=1e-5)
        pm.unmerge_adapter()
        torch.testing.assert_close(pm(ids).logits, adapted, rtol=1e-6, atol=1e-6)


def test_accelerate_rejects_a_model_without_lora_layers():
    with pytest.raises(ValueError, match="no PEFT LoRA layer"):
        accelerate_peft(tiny_llama())


# ---------------------------------------------------------------------------------- inject


def test_inject_adapts_what_peft_adapts():
    from peft import LoraConfig, get_peft_model

    kw = dict(r=4, lora_alpha=8, rank_pattern={"down_proj": 2}, alpha_pattern={"k_proj": 3})
    targets = ["k_proj", "down_proj", "o_proj"]
    pm = get_peft_model(tiny_llama(), LoraConfig(use_dora=True, target_modules=targets, **kw))
    model = tiny_llama()
    ids = token_ids(model.config)
    with torch.no_grad():
        base = model(ids).logits
    assert inject(model, target_modules=targets, **kw) is model
    layers = dora_layers(model)
    peft_layers = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules()
                   if hasattr(m, "lora_magnitude_vector") and m.lora_magnitude_vector}  # fmt: skip
    assert layers.keys() == peft_layers.keys()
    for name, layer in layers.items():
        ref = peft_layers[name]
        assert layer.lora_A.shape == ref.lora_A["default"].weight.shape
        assert layer.scaling == ref.scaling["default"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(
        n.endswith(("lora_A", "lora_B", "lora_magnitude_vector")) for n in trainable
    )
    with torch.no_grad():  # a fresh adapter reproduces the base model
        torch.testing.assert_close(model(ids).logits, base, rtol=1e-5, atol=1e-6)


def test_inject_checks_before_touching_the_model():
    model = tiny_llama()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"not plain nn\.Linear.*embed_tokens"):
        inject(model, target_modules=["q_proj", "embed_tokens"], r=2, lora_alpha=2)
    with pytest.raises(ValueError, match="matches no module"):
        inject(model, target_modules=["nope"], r=2, lora_alpha=2)
    assert {n: type(m) for n, m in model.named_modules()} == before
    inject(model, target_modules=["q_proj"], r=2, lora_alpha=2)
    with pytest.raises(ValueError, match="already adapted layers"):
        inject(model, target_modules=["q_proj"], r=2, lora_alpha=2)


# ---------------------------------------------------------------------------- adapter files


PEFT_KW = dict(
    target_modules=("q_proj", "v_proj", "down_proj"),
    r=4,
    lora_alpha=8,
    rank_pattern={"down_proj": 2},
    alpha_pattern={"layers.1.self_attn.q_proj": 3},
)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_file_loads_into_dora_torch_and_back(tmp_path, use_rslora):
    from peft import PeftModel

    pm = peft_dora(tiny_llama(seed=3), use_rslora=use_rslora, **PEFT_KW)
    pm.save_pretrained(tmp_path / "peft")
    ids = token_ids(pm.base_model.model.config)
    with torch.no_grad():
        want = pm(ids).logits
    model = load_adapter(tiny_llama(seed=3), tmp_path / "peft")  # injects from the file
    assert all(layer.use_rslora == use_rslora for layer in dora_layers(model).values())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-6)
    save_adapter(model, tmp_path / "ours")
    a, b = pf.read_adapter(tmp_path / "peft"), pf.read_adapter(tmp_path / "ours")
    assert a.tensors.keys() == b.tensors.keys()
    for p in a.tensors:
        for name in pf.TENSOR_SUFFIXES:
            assert (a.tensors[p][name] == b.tensors[p][name]).all(), (p, name)
    back = PeftModel.from_pretrained(tiny_llama(seed=3), tmp_path / "ours").eval()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)
    # Loading into the already adapted model (exact fit) works too.
    load_adapter(model, tmp_path / "ours")


def test_bf16_adapters_round_trip_bit_exactly(tmp_path):
    model = inject(tiny_llama(), target_modules=["q_proj"], r=2, lora_alpha=4,
                   adapter_dtype=torch.bfloat16)  # fmt: skip
    with torch.no_grad():
        for layer in dora_layers(model).values():
            layer.lora_B.normal_()
            layer.lora_magnitude_vector.mul_(1.5)
    save_adapter(model, tmp_path / "a")
    other = inject(tiny_llama(), target_modules=["q_proj"], r=2, lora_alpha=4,
                   adapter_dtype=torch.bfloat16)  # fmt: skip
    load_adapter(other, tmp_path / "a")
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), n


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_bad_file_leaves_the_model_unchanged(tmp_path):
    pm = peft_dora(tiny_llama(seed=3), **PEFT_KW)
    pm.save_pretrained(tmp_path / "peft")
    # A model adapted differently: other alpha on q_proj, v_proj not adapted, up_proj adapted.
    model = inject(tiny_llama(seed=3), target_modules=["q_proj", "down_proj", "up_proj"], r=4,
                   lora_alpha=16, rank_pattern={"down_proj": 2})  # fmt: skip
    before = _state(model)
    with pytest.raises(pf.AdapterFormatError) as e:
        load_adapter(model, tmp_path / "peft")
    msg = str(e.value)
    assert "scale: model.layers.0.self_attn.q_proj has scaling 4" in msg
    assert "extra: the file has tensors for model.layers.0.self_attn.v_proj" in msg
    assert "missing: the model adapts model.layers.0.mlp.up_proj" in msg
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # No DoRA layer yet and a file naming a module that is not an nn.Linear: nothing injected.
    plain = tiny_llama(seed=3)
    ad = pf.read_adapter(tmp_path / "peft")
    ad.tensors["model.norm"] = ad.tensors["model.layers.0.self_attn.q_proj"]
    pf.write_adapter(tmp_path / "bad", ad)
    with pytest.raises(pf.AdapterFormatError, match=r"extra: the file has tensors for model\.norm"):
        load_adapter(plain, tmp_path / "bad")
    assert not dora_layers(plain)


def test_save_needs_dora_layers(tmp_path):
    with pytest.raises(ValueError, match=r"no dora_torch\.Linear"):
        save_adapter(tiny_llama(), tmp_path / "x")
    assert isinstance(dora_torch.Linear, type) and issubclass(dora_torch.Linear, nn.Module)
