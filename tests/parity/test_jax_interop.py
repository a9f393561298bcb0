"""dora_jax adapter files: key maps, validation before writing, caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dora_jax
from dora_jax.interop.adapter_io import load_peft_adapter, save_peft_adapter
from dora_jax.models.llama import from_torch_state_dict
from shared_spec import peft_format as pf
from tests.parity.models import tiny_llama, token_ids

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _adapted(seed=0, target=r"(q|v)_proj$"):
    hf = tiny_llama()
    model = from_torch_state_dict(hf.config, hf.state_dict())
    dora_jax.inject(model, target=target, rank=4, alpha=8, rngs=nnx.Rngs(seed))
    for _, layer in nnx.iter_graph(model):
        if isinstance(layer, dora_jax.DoraDense):  # non-trivial adapters
            b = layer.lora_b.get_value()
            layer.lora_b.set_value(0.1 * jax.random.normal(jax.random.key(seed), b.shape, b.dtype))
    return model


def _arrays(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def _logits(model):
    return np.asarray(model(jnp.asarray(token_ids(tiny_llama().config).numpy())))


def test_custom_key_map(tmp_path):
    model = _adapted()
    key_map = {f"decoder.block.{i}.attn.{k}": ("model", "layers", i, "self_attn", f"{k}_proj")
               for i in range(2) for k in "qv"}  # fmt: skip
    save_peft_adapter(model, tmp_path / "a", key_map=key_map)
    ad = pf.read_adapter(tmp_path / "a")
    assert set(ad.tensors) == set(key_map)
    assert all(pf.matches_target(ad.config.target_modules, p) for p in key_map)
    other = _adapted(seed=5)
    load_peft_adapter(other, tmp_path / "a", key_map=key_map)
    np.testing.assert_array_equal(_logits(other), _logits(model))
    with pytest.raises(pf.AdapterFormatError) as e:  # without the map nothing lines up
        load_peft_adapter(other, tmp_path / "a")
    assert "extra: the file has tensors for decoder.block.0.attn.q" in str(e.value)
    assert "missing: the model adapts model.layers.0.self_attn.q_proj" in str(e.value)
    with pytest.raises(ValueError, match="key_map has no PEFT path"):
        save_peft_adapter(model, tmp_path / "b", key_map=dict(list(key_map.items())[:3]))


def test_a_bad_file_leaves_the_model_unchanged(tmp_path):
    save_peft_adapter(_adapted(), tmp_path / "a")
    ad = pf.read_adapter(tmp_path / "a")
    q0 = "model.layers.0.self_attn.q_proj"
    ad.tensors[q0][pf.LORA_A] = ad.tensors[q0][pf.LORA_A][:, :16]  # d_in 16, the layer has 32
    ad.tensors["model.layers.1.mlp.up_proj"] = ad.tensors.pop("model.layers.1.self_attn.v_proj")
    pf.write_adapter(tmp_path / "bad", ad)
    model = _adapted(seed=1)
    before = _arrays(model)
    with pytest.raises(pf.AdapterFormatError) as e:
        load_peft_adapter(model, tmp_path / "bad")
    msg = str(e.value)
    assert f"shape: base_model.model.{q0}.lora_A.weight is (4, 16)" in msg
    assert "missing: the model adapts model.layers.1.self_attn.v_proj" in msg
    assert "extra: the file has tensors for model.layers.1.mlp.up_proj" in msg
    assert all(np.array_equal(a, b) for a, b in zip(before, _arrays(model)))
    plain = from_torch_state_dict(tiny_llama().config, tiny_llama().state_dict())
    with pytest.raises(pf.AdapterFormatError):
        load_peft_adapter(plain, tmp_path / "bad")
    assert not any(isinstance(m, dora_jax.DoraDense) for _, m in nnx.iter_graph(plain))


def test_loading_clears_a_frozen_norm(tmp_path):
    src = _adapted(seed=2)
    save_peft_adapter(src, tmp_path / "a")
    model = _adapted(seed=3)
    for _, layer in nnx.iter_graph(model):
        if isinstance(layer, dora_jax.DoraDense):
            layer.freeze_norm()
    load_peft_adapter(model, tmp_path / "a")
    np.testing.assert_allclose(_logits(model), _logits(src), rtol=1e-6, atol=1e-6)
