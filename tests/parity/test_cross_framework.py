"""One adapter, three homes: PEFT, dora_torch and the Flax nnx Llama twin agree on logits, and
adapter files travel between them unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import dora_jax
from dora_jax.interop.adapter_io import load_peft_adapter, save_peft_adapter
from dora_jax.models.llama import from_torch_state_dict
from dora_torch.interop.adapter_io import load_adapter, save_adapter
from dora_torch.interop.inject import dora_layers, inject
from dora_torch.interop.peft_accel import accelerate_peft
from shared_spec import peft_format as pf
from shared_spec.tolerances import assert_close
from tests.parity.models import ALL_PROJ, peft_dora, tiny_llama, token_ids

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning"),
]

PEFT_KW = dict(
    target_modules=("q_proj", "v_proj", "down_proj", "lm_head"),
    r=4,
    lora_alpha=8,
    rank_pattern={"down_proj": 2},
    alpha_pattern={"layers.1.self_attn.q_proj": 3},
)
SEED = 3


def _twin(torch_model, dtype=None):
    return from_torch_state_dict(torch_model.config, torch_model.state_dict(), dtype=dtype)


def _jax_logits(model, ids) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids.numpy())).astype(jnp.float32), np.float64)


def _torch_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(ids).logits.double().numpy()


def _same_tensors(a: pf.Adapter, b: pf.Adapter):
    assert a.tensors.keys() == b.tensors.keys()
    for p in a.tensors:
        for name in pf.TENSOR_SUFFIXES:
            x, y = a.tensors[p][name], b.tensors[p][name]
            assert x.dtype == y.dtype and x.shape == y.shape, (p, name)
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), (p, name)  # bit for bit


@pytest.mark.parametrize("use_rslora", [False, True])
def test_round_trip_peft_torch_jax_peft_is_bit_exact(tmp_path, use_rslora):
    from peft import PeftModel

    pm = peft_dora(tiny_llama(seed=SEED), use_rslora=use_rslora, **PEFT_KW)
    pm.save_pretrained(tmp_path / "0_peft")
    ids = token_ids(pm.base_model.model.config)
    want = _torch_logits(pm, ids)

    torch_model = load_adapter(tiny_llama(seed=SEED), tmp_path / "0_peft")
    save_adapter(torch_model, tmp_path / "1_torch")
    jax_model = load_peft_adapter(_twin(tiny_llama(seed=SEED)), tmp_path / "1_torch")
    save_peft_adapter(jax_model, tmp_path / "2_jax")
    back = PeftModel.from_pretrained(tiny_llama(seed=SEED), tmp_path / "2_jax").eval()

    first = pf.read_adapter(tmp_path / "0_peft")
    # PEFT also saved lm_head's base weight (the loaders write it back; the savers omit it).
    assert first.tensors["lm_head"].pop(pf.BASE_WEIGHT).shape == (96, 32)
    for d in ("1_torch", "2_jax"):
        _same_tensors(pf.read_adapter(tmp_path / d), first)
        cfg = pf.read_adapter(tmp_path / d).config
        assert all(cfg.scaling(p) == first.config.scaling(p) for p in first.tensors)
    assert np.array_equal(_torch_logits(back, ids), want)  # PEFT reproduces itself exactly
    for got in (_torch_logits(torch_model, ids), _jax_logits(jax_model, ids)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_adapters_round_trip_through_jax(tmp_path):
    model = _twin(tiny_llama())
    dora_jax.inject(model, target=r"(q|v)_proj$", rank=2, alpha=4, rngs=nnx.Rngs(1),
                    adapter_dtype=jnp.bfloat16)  # fmt: skip
    for _, layer in nnx.iter_graph(model):
        if isinstance(layer, dora_jax.DoraDense):
            b = layer.lora_b.get_value()
            layer.lora_b.set_value(jax.random.normal(jax.random.key(0), b.shape, b.dtype))
    save_peft_adapter(model, tmp_path / "a")
    other = _twin(tiny_llama())
    dora_jax.inject(other, target=r"(q|v)_proj$", rank=2, alpha=4, rngs=nnx.Rngs(2),
                    adapter_dtype=jnp.bfloat16)  # fmt: skip
    load_peft_adapter(other, tmp_path / "a")
    save_peft_adapter(other, tmp_path / "b")
    _same_tensors(pf.read_adapter(tmp_path / "a"), pf.read_adapter(tmp_path / "b"))
    assert pf.read_adapter(tmp_path / "a").tensors["model.layers.0.self_attn.q_proj"][
        pf.LORA_B
    ].dtype == np.dtype(jnp.bfloat16)


def _train_torch(model, ids, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    return model.eval()


def test_torch_trained_adapter_reproduces_logits_in_flax(tmp_path):
    model = inject(tiny_llama(), target_modules=ALL_PROJ, r=4, lora_alpha=8,
                   rank_pattern={"o_proj": 2})  # fmt: skip
    ids = token_ids(model.config)
    before = _torch_logits(model, ids)
    _train_torch(model, ids)
    want = _torch_logits(model, ids)
    assert np.abs(want - before).max() > 1e-2  # training moved the adapter
    save_adapter(model, tmp_path / "a")
    twin = load_peft_adapter(_twin(tiny_llama()), tmp_path / "a")
    np.testing.assert_allclose(_jax_logits(twin, ids), want, rtol=1e-5, atol=1e-5)


def _train_jax(model, ids, steps=3):
    opt = nnx.Optimizer(model, optax.adamw(2e-2), wrt=nnx.LoRAParam)
    tokens = jnp.asarray(ids.numpy())

    def loss_fn(m):
        logits = m(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @nnx.jit
    def step(m, o):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        o.update(m, grads)
        return loss

    return [float(step(model, opt)) for _ in range(steps)]


def test_flax_trained_adapter_reproduces_logits_in_torch_and_peft(tmp_path):
    from peft import PeftModel

    hf = tiny_llama()
    ids = token_ids(hf.config)
    model = _twin(hf)
    dora_jax.inject(model, target=r"(q_proj|v_proj|up_proj)$", rank=4, alpha=8, rngs=nnx.Rngs(0))
    losses = _train_jax(model, ids)
    assert losses[-1] < losses[0]
    want = _jax_logits(model, ids)
    save_peft_adapter(model, tmp_path / "a")
    torch_model = load_adapter(tiny_llama(), tmp_path / "a")
    assert len(dora_layers(torch_model)) == 6
    peft_model = PeftModel.from_pretrained(tiny_llama(), tmp_path / "a").eval()
    for got in (_torch_logits(torch_model, ids), _torch_logits(peft_model, ids)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_logits_against_the_fp64_reference(tmp_path):
    """Every implementation against PEFT's formula in float64, by the shared tolerance rule:
    in fp32 with PEFT's fp32 model as the same-dtype baseline, in bf16 with PEFT's bf16 model.
    (A cosine ≥ 0.99999 would let ~4e-3 relative error through: ~30000 fp32 ulps.)"""
    from peft import PeftModel

    pm = peft_dora(tiny_llama(seed=SEED), target_modules=ALL_PROJ, r=4, lora_alpha=7)  # s = 1.75
    pm.save_pretrained(tmp_path / "a")
    ids = token_ids(pm.base_model.model.config, seq=16)
    ref64 = PeftModel.from_pretrained(tiny_llama(seed=SEED), tmp_path / "a").double().eval()
    ref = _torch_logits(ref64, ids)  # PEFT's dense formula evaluated in float64

    baseline32 = _torch_logits(pm, ids)  # PEFT in fp32: plain framework code
    ours32 = {
        "peft+accelerate_peft": _torch_logits(accelerate_peft(pm), ids),
        "dora_torch": _torch_logits(load_adapter(tiny_llama(seed=SEED), tmp_path / "a"), ids),
        "dora_jax": _jax_logits(
            load_peft_adapter(_twin(tiny_llama(seed=SEED)), tmp_path / "a"), ids
        ),
    }
    for name, logits in ours32.items():
        assert_close(logits, ref, baseline32, machine_eps=2.0**-23, name=f"fp32 {name}")

    base16 = tiny_llama(seed=SEED).to(torch.bfloat16)
    peft16 = PeftModel.from_pretrained(base16, tmp_path / "a", autocast_adapter_dtype=False)
    peft16 = peft16.to(torch.bfloat16).eval()
    baseline = _torch_logits(peft16, ids)
    ours16 = {
        "peft+accelerate_peft": _torch_logits(accelerate_peft(peft16), ids),
        "dora_torch": _torch_logits(
            load_adapter(tiny_llama(seed=SEED).to(torch.bfloat16), tmp_path / "a"), ids
        ),
        "dora_jax": _jax_logits(
            load_peft_adapter(_twin(tiny_llama(seed=SEED), dtype=jnp.bfloat16), tmp_path / "a"),
            ids,
        ),
    }
    for name, logits in ours16.items():
        assert_close(logits, ref, baseline, machine_eps=2.0**-7, name=f"bf16 {name}")
