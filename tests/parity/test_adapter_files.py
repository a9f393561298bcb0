"""Adapter files in both backends: bare layers, NaN/inf, dropout, adapter dtypes, names.

dora_torch.save_adapter / load_adapter and dora_jax.interop.save_adapter / load_adapter go
through shared_spec.peft_format, so each rule is checked once there and tested here in both.
"""

from __future__ import annotations

import json
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

import dora_jax
import dora_torch
from dora_jax.interop import adapter_io as jio
from dora_torch.interop.adapter_io import load_adapter, save_adapter
from dora_torch.interop.inject import dora_layers, inject
from shared_spec import peft_format as pf
from tests.parity.models import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class _TorchMlp(nn.Module):
    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(16, 24, dtype=dtype)
        self.down = nn.Linear(24, 8, dtype=dtype)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _JaxMlp(nnx.Module):
    """The same module names as _TorchMlp ("up", "down")."""

    def __init__(self, seed=0, param_dtype=jnp.float32):
        rngs = nnx.Rngs(seed)
        self.up = nnx.Linear(16, 24, param_dtype=param_dtype, rngs=rngs)
        self.down = nnx.Linear(24, 8, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def _torch_adapted(dtype=torch.float32, adapter_dtype=None, lora_dropout=0.0, seed=0):
    model = inject(_TorchMlp(dtype, seed), target_modules=["up", "down"], r=2, lora_alpha=4,
                   lora_dropout=lora_dropout, adapter_dtype=adapter_dtype)  # fmt: skip
    with torch.no_grad():  # non-trivial adapters
        for layer in dora_layers(model).values():
            layer.lora_B.normal_()
            layer.lora_magnitude_vector.mul_(1.25)
    return model


def _jax_adapted(lora_dropout=0.0):
    model = _JaxMlp()
    dora_jax.inject(model, target_modules=["up", "down"], r=2, lora_alpha=4,
                    lora_dropout=lora_dropout, rngs=nnx.Rngs(1))  # fmt: skip
    return model


def _jax_dora(model) -> dict[str, dora_jax.DoraDense]:
    return {
        ".".join(map(str, p)): m
        for p, m in nnx.iter_graph(model)
        if isinstance(m, dora_jax.DoraDense)
    }


def _config(path) -> dict:
    return json.loads((path / pf.CONFIG_NAME).read_text())


# --------------------------------------------------------------------------- bare layers


BARE = "module path '' is empty.*save the model that contains the layer"


def test_torch_save_refuses_a_bare_layer(tmp_path):
    layer = dora_torch.Linear(16, 8, r=2, lora_alpha=4)
    with pytest.raises(ValueError, match=BARE):
        save_adapter(layer, tmp_path / "bare")
    assert not (tmp_path / "bare").exists()
    # the enclosing model saves, and the file round-trips into a plain model of that shape
    with torch.no_grad():
        layer.lora_B.normal_()
    holder = nn.Module()
    holder.proj = layer
    save_adapter(holder, tmp_path / "held")
    assert set(pf.read_adapter(tmp_path / "held").tensors) == {"proj"}
    plain = nn.Module()
    plain.proj = nn.Linear(16, 8)
    with torch.no_grad():
        plain.proj.weight.copy_(layer.weight)
        plain.proj.bias.copy_(layer.bias)
    load_adapter(plain, tmp_path / "held")
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(plain.proj(x), layer(x))


@pytest.mark.filterwarnings("ignore:save_peft_adapter is deprecated:DeprecationWarning")
@pytest.mark.parametrize("save", [jio.save_adapter, jio.save_peft_adapter])
def test_jax_save_refuses_a_bare_layer(tmp_path, save):
    layer = dora_jax.DoraDense(16, 8, r=2, lora_alpha=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=BARE):
        save(layer, tmp_path / "bare")
    assert not (tmp_path / "bare").exists()


def test_write_adapter_refuses_unnamed_modules(tmp_path):
    good = pf.read_adapter(_saved_torch(tmp_path / "a"))
    t = good.tensors["up"]
    for bad_path, message in (("", "module path '' is empty"),
                              ("up..x", "module path 'up..x' has an empty component")):  # fmt: skip
        with pytest.raises(pf.AdapterFormatError, match=message):
            pf.write_adapter(tmp_path / "b", pf.Adapter(good.config, {bad_path: t}))
    assert not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------- NaN / inf


def _saved_torch(path, **kw):
    save_adapter(_torch_adapted(**kw), path)
    return path


def _corrupt(src, dst, path: str, name: str, value: float):
    """Copy adapter ``src`` to ``dst`` with one element of tensor ``name`` of module ``path``
    set to ``value`` (``base_layer.weight`` is added), bypassing ``write_adapter``'s checks."""
    from safetensors.numpy import load_file, save_file

    flat = load_file(str(src / pf.WEIGHTS_NAME))
    key = pf.tensor_key(path, name)
    if name == pf.BASE_WEIGHT:
        a = flat[pf.tensor_key(path, pf.LORA_B)]
        flat[key] = np.zeros((a.shape[0], flat[pf.tensor_key(path, pf.LORA_A)].shape[1]), a.dtype)
    a = flat[key].copy()
    a.reshape(-1)[1] = value
    flat[key] = a
    dst.mkdir()
    save_file(flat, str(dst / pf.WEIGHTS_NAME), metadata={"format": "pt"})
    (dst / pf.CONFIG_NAME).write_text((src / pf.CONFIG_NAME).read_text())
    return key


NONFINITE = [
    (pf.LORA_A, math.nan, None),
    (pf.LORA_B, math.inf, None),
    (pf.MAGNITUDE, -math.inf, torch.bfloat16),
    (pf.LORA_B, math.nan, torch.bfloat16),
    (pf.BASE_WEIGHT, math.nan, None),
]


@pytest.mark.parametrize(("name", "value", "adapter_dtype"), NONFINITE)
def test_nonfinite_values_are_refused_on_load(tmp_path, name, value, adapter_dtype):
    src = _saved_torch(tmp_path / "good", adapter_dtype=adapter_dtype)
    key = _corrupt(src, tmp_path / "bad", "down", name, value)
    message = rf"{key} holds 1 non-finite value\(s\) \(NaN or inf\)"
    with pytest.raises(pf.AdapterFormatError, match=message):
        pf.read_adapter(tmp_path / "bad")
    # torch: into a plain model (nothing injected) and into an adapted one (unchanged)
    plain = _TorchMlp()
    with pytest.raises(pf.AdapterFormatError, match=message):
        load_adapter(plain, tmp_path / "bad")
    assert not dora_layers(plain)
    adapted = _torch_adapted(adapter_dtype=adapter_dtype, seed=0)
    before = {k: v.clone() for k, v in adapted.state_dict().items()}
    with pytest.raises(pf.AdapterFormatError, match=message):
        load_adapter(adapted, tmp_path / "bad")
    assert all(torch.equal(before[k], v) for k, v in adapted.state_dict().items())
    # jax: both file functions, plain and adapted models
    plain_jax = _JaxMlp()
    with pytest.raises(pf.AdapterFormatError, match=message):
        jio.load_adapter(plain_jax, tmp_path / "bad")
    assert not _jax_dora(plain_jax)
    with pytest.raises(pf.AdapterFormatError, match=message):
        jio.load_adapter(_jax_adapted(), tmp_path / "bad")


def test_nonfinite_values_are_refused_on_save(tmp_path):
    model = _torch_adapted()
    with torch.no_grad():
        model.up.lora_B[0, 0] = math.nan
    with pytest.raises(pf.AdapterFormatError, match=r"base_model\.model\.up\.lora_B\.weight holds"):
        save_adapter(model, tmp_path / "t")
    assert not (tmp_path / "t").exists()
    jmodel = _jax_adapted()
    m = jmodel.down.magnitude.get_value()
    jmodel.down.magnitude.set_value(m.at[3].set(np.inf))
    with pytest.raises(pf.AdapterFormatError, match=r"down\.lora_magnitude_vector holds 1"):
        jio.save_adapter(jmodel, tmp_path / "j")
    assert not (tmp_path / "j").exists()


# ------------------------------------------------------------------------------- dropout


def test_jax_dropout_survives_round_trips(tmp_path):
    jio.save_adapter(_jax_adapted(lora_dropout=0.1), tmp_path / "jax")
    assert _config(tmp_path / "jax")["lora_dropout"] == pytest.approx(0.1)
    plain = _JaxMlp()
    jio.load_adapter(plain, tmp_path / "jax")  # injects with the file's rate
    assert {n: m.lora_dropout for n, m in _jax_dora(plain).items()} == {"up": 0.1, "down": 0.1}
    torch_model = load_adapter(_TorchMlp(), tmp_path / "jax")
    assert {n: m.lora_dropout for n, m in dora_layers(torch_model).items()} == {
        "up": pytest.approx(0.1),
        "down": pytest.approx(0.1),
    }
    # and a torch file's rate reaches dora_jax
    _saved_torch(tmp_path / "torch", lora_dropout=0.2)
    plain = _JaxMlp()
    jio.load_adapter(plain, tmp_path / "torch")
    assert {m.lora_dropout for m in _jax_dora(plain).values()} == {0.2}
    jio.save_adapter(plain, tmp_path / "again")
    assert _config(tmp_path / "again")["lora_dropout"] == pytest.approx(0.2)


def test_different_dropout_rates_are_refused_on_save(tmp_path):
    message = r"different lora_dropout rates \(lora_dropout=0: down; lora_dropout=0\.1: up\)"
    model = inject(_TorchMlp(), target_modules=["up"], r=2, lora_alpha=4, lora_dropout=0.1)
    inject(model, target_modules=["down"], r=2, lora_alpha=4)
    with pytest.raises(ValueError, match=message):
        save_adapter(model, tmp_path / "t")
    assert not (tmp_path / "t").exists()
    jmodel = _JaxMlp()
    dora_jax.inject(jmodel, target_modules=["up"], r=2, lora_alpha=4, lora_dropout=0.1,
                    rngs=nnx.Rngs(1))  # fmt: skip
    dora_jax.inject(jmodel, target_modules=["down"], r=2, lora_alpha=4, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=message):
        jio.save_adapter(jmodel, tmp_path / "j")
    assert not (tmp_path / "j").exists()


def test_common_dropout_names_every_group():
    assert pf.common_dropout({"a": 0.1, "b": 0.1}) == 0.1
    rates = {f"m{i}": 0.05 for i in range(10)} | {"x": 0.0}
    with pytest.raises(ValueError) as e:
        pf.common_dropout(rates)
    msg = str(e.value)
    assert "lora_dropout=0.05: m0, m1" in msg and "and 2 more" in msg
    assert "lora_dropout=0: x" in msg


# ----------------------------------------------------------------------- adapter dtypes


def test_float64_base_gets_float64_adapters(tmp_path):
    """PEFT's rule: adapters take the base dtype (fp32 only over fp16/bf16 bases)."""
    model = _torch_adapted(dtype=torch.float64)
    for layer in dora_layers(model).values():
        for p in (layer.lora_A, layer.lora_B, layer.lora_magnitude_vector):
            assert p.dtype == torch.float64
    save_adapter(model, tmp_path / "a")
    loaded = load_adapter(_TorchMlp(torch.float64), tmp_path / "a")
    for layer in dora_layers(loaded).values():
        for p in (layer.lora_A, layer.lora_B, layer.lora_magnitude_vector):
            assert p.dtype == torch.float64
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("base", [torch.bfloat16, torch.float16])
def test_half_base_gets_float32_adapters_unless_told(tmp_path, base):
    model = _torch_adapted(dtype=base)
    assert {p.dtype for layer in dora_layers(model).values()
            for p in (layer.lora_A, layer.lora_B)} == {torch.float32}  # fmt: skip
    save_adapter(model, tmp_path / "a")
    loaded = load_adapter(_TorchMlp(base), tmp_path / "a")
    assert {layer.lora_A.dtype for layer in dora_layers(loaded).values()} == {torch.float32}
    loaded = load_adapter(_TorchMlp(base), tmp_path / "a", adapter_dtype=base)
    assert {layer.lora_A.dtype for layer in dora_layers(loaded).values()} == {base}


def test_jax_load_adapter_dtype(tmp_path):
    jio.save_adapter(_jax_adapted(), tmp_path / "a")
    model = jio.load_adapter(_JaxMlp(param_dtype=jnp.bfloat16), tmp_path / "a")
    dtypes = {m.lora_a.get_value().dtype for m in _jax_dora(model).values()}
    assert dtypes == {jnp.dtype(jnp.float32)}  # PEFT's rule over a bfloat16 kernel
    model = jio.load_adapter(_JaxMlp(param_dtype=jnp.bfloat16), tmp_path / "a",
                             adapter_dtype=jnp.bfloat16)  # fmt: skip
    dtypes = {m.magnitude.get_value().dtype for m in _jax_dora(model).values()}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}


# ------------------------------------------------------------------------ names in jax


def test_jax_file_functions_use_torch_names(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new names never warn
        jio.save_adapter(_jax_adapted(), tmp_path / "a")
        jio.load_adapter(_JaxMlp(), tmp_path / "a")
    with pytest.warns(DeprecationWarning, match=r"use dora_jax\.save_adapter"):
        jio.save_peft_adapter(_jax_adapted(), tmp_path / "b")
    with pytest.warns(DeprecationWarning, match=r"use dora_jax\.load_adapter"):
        model = jio.load_peft_adapter(_JaxMlp(), tmp_path / "b")
    assert sorted(_jax_dora(model)) == ["down", "up"]
    from dora_jax import interop

    assert interop.save_adapter is jio.save_adapter and interop.load_adapter is jio.load_adapter


TARGETS = [
    ["q_proj", "v_proj"],
    r".*\.mlp\..*_proj",
    ["layers.1.self_attn.o_proj", "down_proj"],
    "model.layers.0.self_attn.(k|q)_proj",
]


@pytest.mark.parametrize("target_modules", TARGETS)
def test_jax_inject_selects_what_torch_inject_selects(target_modules):
    from dora_jax.models.llama import from_torch_state_dict

    hf = tiny_llama()
    jmodel = from_torch_state_dict(hf.config, hf.state_dict())
    kw = dict(target_modules=target_modules, r=4, lora_alpha=8, rank_pattern={"v_proj": 2},
              alpha_pattern={r"model\.layers\.1\..*": 3})  # fmt: skip
    names = dora_jax.inject(jmodel, **kw, rngs=nnx.Rngs(0))
    tmodel = inject(tiny_llama(), **kw)
    torch_layers = dora_layers(tmodel)
    assert sorted(names) == sorted(torch_layers)
    jax_layers = _jax_dora(jmodel)
    assert {n: (m.r, m.lora_alpha) for n, m in jax_layers.items()} == {
        n: (m.r, m.lora_alpha) for n, m in torch_layers.items()
    }
