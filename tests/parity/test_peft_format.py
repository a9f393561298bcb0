"""shared_spec.peft_format against PEFT itself: pattern semantics, files PEFT writes and reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shared_spec import peft_format as pf
from tests.parity.models import peft_dora, tiny_llama, token_ids

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PATHS = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.1.self_attn.q_proj",
    "model.layers.11.self_attn.q_proj",
    "model.layers.1.mlp.down_proj",
    "model.layers.1.mlp.down_proj_extra",
    "lm_head",
]
PATTERNS = [
    {},
    {"q_proj": 8},
    {"layers.1.self_attn.q_proj": 2, "q_proj": 8},
    {r"model\.layers\.1\.self_attn\.q_proj": 3},
    {"down_proj": 5, ".*layers\\.1\\..*": 7},
    {"proj": 1},  # a bare suffix must follow a dot to match: never matches "q_proj"
    {"layers.1": 2},
]


@pytest.mark.parametrize("patterns", PATTERNS)
def test_pattern_key_is_peft_get_pattern_key(patterns):
    from peft.utils.other import get_pattern_key

    for path in PATHS:
        ours = pf.pattern_key(patterns, path)
        theirs = get_pattern_key(patterns.keys(), path)
        assert (path if ours is None else ours) == theirs, (patterns, path)


@pytest.mark.parametrize(
    "target",
    [["q_proj"], ["down_proj", "lm_head"], "model.layers.1.*", r".*\.(q|v)_proj", ["proj"]],
)
def test_matches_target_is_peft_check_target_module_exists(target):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    cfg = LoraConfig(target_modules=target)
    for path in PATHS:
        assert pf.matches_target(target, path) == bool(check_target_module_exists(cfg, path))


def test_target_modules_for_is_exact():
    candidates = [*PATHS, "model.layers.0.self_attn.v_proj"]
    adapted = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
               "model.layers.11.self_attn.q_proj"]  # fmt: skip
    assert pf.target_modules_for(adapted, candidates) == ["q_proj"]
    only_some = adapted[:2]  # suffix "q_proj" would also pick layer 11: fall back to a regex
    t = pf.target_modules_for(only_some, candidates)
    assert isinstance(t, str)
    assert {p for p in candidates if pf.matches_target(t, p)} == set(only_some)
    with pytest.raises(ValueError, match="at least one"):
        pf.target_modules_for([], candidates)


def test_config_for_layers_reproduces_every_layer():
    layers = {p: (4, 8) for p in PATHS}
    layers["model.layers.1.self_attn.q_proj"] = (2, 8)
    layers["model.layers.11.self_attn.q_proj"] = (4, 3)
    cfg = pf.config_for_layers(layers, use_rslora=True, target_modules=["x"])
    assert (cfg.r, cfg.lora_alpha) == (4, 8)
    for p, (r, a) in layers.items():
        assert (cfg.rank(p), cfg.alpha(p)) == (r, a), p
        assert cfg.scaling(p) == pytest.approx(a / r**0.5)
    assert len(cfg.rank_pattern) == 1 and len(cfg.alpha_pattern) == 1


def _save_peft(tmp_path, name="peft", **kw):
    pm = peft_dora(tiny_llama(seed=3), **kw)
    pm.save_pretrained(tmp_path / name)
    return pm


def _peft_logits(adapter_dir, ids):
    from peft import PeftModel

    pm = PeftModel.from_pretrained(tiny_llama(seed=3), adapter_dir).eval()
    with torch.no_grad():
        return pm(ids).logits


PEFT_KW = dict(
    target_modules=("q_proj", "v_proj", "down_proj"),
    r=4,
    lora_alpha=8,
    rank_pattern={"down_proj": 2},
    alpha_pattern={"layers.1.self_attn.q_proj": 3},
)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_file_round_trips_through_the_format_layer(tmp_path, use_rslora):
    pm = _save_peft(tmp_path, use_rslora=use_rslora, **PEFT_KW)
    ids = token_ids(pm.base_model.model.config)
    with torch.no_grad():
        want = pm(ids).logits
    ad = pf.read_adapter(tmp_path / "peft")
    assert len(ad.tensors) == 6
    for path, t in ad.tensors.items():
        layer = pm.base_model.model.get_submodule(path)
        assert layer.r["default"] == ad.config.rank(path)
        assert layer.scaling["default"] == pytest.approx(ad.config.scaling(path), rel=1e-12)
        np.testing.assert_array_equal(t[pf.LORA_A], layer.lora_A["default"].weight.detach())
        np.testing.assert_array_equal(t[pf.LORA_B], layer.lora_B["default"].weight.detach())
        mag = layer.lora_magnitude_vector["default"].weight.detach()
        np.testing.assert_array_equal(t[pf.MAGNITUDE], mag)
    # Written back verbatim, and with a config rebuilt from per-layer (r, alpha): PEFT
    # loads both into exactly the same model.
    pf.write_adapter(tmp_path / "same", ad)
    layers = {p: (ad.config.rank(p), ad.config.alpha(p)) for p in ad.tensors}
    rebuilt = pf.config_for_layers(
        layers,
        use_rslora=use_rslora,
        target_modules=pf.target_modules_for(layers, [n for n, _ in tiny_llama().named_modules()]),
    )
    pf.write_adapter(tmp_path / "rebuilt", pf.Adapter(rebuilt, ad.tensors))
    for d in ("same", "rebuilt"):
        assert torch.equal(_peft_logits(tmp_path / d, ids), want), d
    assert json.loads((tmp_path / "same" / pf.CONFIG_NAME).read_text())["peft_version"]


def _problems(excinfo) -> str:
    assert isinstance(excinfo.value, pf.AdapterFormatError)
    return str(excinfo.value)


def test_corrupt_files_are_reported_together(tmp_path):
    _save_peft(tmp_path)
    d = tmp_path / "peft"
    (d / pf.CONFIG_NAME).write_text("{ not json")
    w = d / pf.WEIGHTS_NAME
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(pf.AdapterFormatError) as e:
        pf.read_adapter(d)
    msg = _problems(e)
    assert "2 problem(s)" in msg
    assert "adapter_config.json is not valid JSON" in msg
    assert "adapter_model.safetensors is corrupt or unreadable" in msg
    with pytest.raises(pf.AdapterFormatError, match="is not a directory"):
        pf.read_adapter(tmp_path / "nope")


def test_bad_config_and_bad_tensors_are_all_listed(tmp_path):
    from safetensors.numpy import load_file, save_file

    _save_peft(tmp_path)
    d = tmp_path / "peft"
    cfg = json.loads((d / pf.CONFIG_NAME).read_text())
    cfg["use_dora"] = False
    (d / pf.CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(pf.AdapterFormatError, match="use_dora is False"):
        pf.read_adapter(d)
    cfg["use_dora"] = True
    cfg["rank_pattern"] = {"model.layers.0.self_attn.v_proj": 3}
    (d / pf.CONFIG_NAME).write_text(json.dumps(cfg))
    t = load_file(str(d / pf.WEIGHTS_NAME))
    q0 = "base_model.model.model.layers.0.self_attn.q_proj"
    del t[f"{q0}.lora_magnitude_vector"]
    t[f"{q0}.lora_A.default.weight"] = np.zeros((4, 32), np.float32)
    t["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"] = np.zeros(
        (32, 5), np.float32
    )
    save_file(t, str(d / pf.WEIGHTS_NAME))
    with pytest.raises(pf.AdapterFormatError) as e:
        pf.read_adapter(d)
    msg = _problems(e)
    assert f"missing key {q0}.lora_magnitude_vector" in msg
    assert f"unexpected key '{q0}.lora_A.default.weight'" in msg
    assert "model.layers.1.self_attn.q_proj: rank mismatch" in msg
    assert "model.layers.0.self_attn.v_proj: tensors have rank 4 but the config gives rank 3" in msg
    assert "4 problem(s)" in msg


def test_validate_against_a_model(tmp_path):
    _save_peft(tmp_path)
    ad = pf.read_adapter(tmp_path / "peft")
    q = "model.layers.{}.self_attn.q_proj"
    v = "model.layers.{}.self_attn.v_proj"
    layers = {q.format(i): pf.LayerSpec(32, 32, r=4, scaling=2.0) for i in (0, 1)}
    layers[v.format(0)] = pf.LayerSpec(16, 32)
    layers[v.format(1)] = pf.LayerSpec(16, 32)
    pf.validate_against(ad, layers)  # fits
    layers[q.format(0)] = pf.LayerSpec(32, 32, r=4, scaling=1.0)
    layers[v.format(1)] = pf.LayerSpec(16, 24)
    del layers[v.format(0)]
    layers["model.layers.0.mlp.up_proj"] = pf.LayerSpec(48, 32)
    with pytest.raises(pf.AdapterFormatError) as e:
        pf.validate_against(ad, layers, where="x")
    msg = _problems(e)
    assert "missing: the model adapts model.layers.0.mlp.up_proj" in msg
    assert f"extra: the file has tensors for {v.format(0)}" in msg
    assert f"shape: base_model.model.{v.format(1)}.lora_A.weight is (4, 32)" in msg
    assert f"scale: {q.format(0)} has scaling 1 in the model but the file gives 2" in msg
    assert "4 problem(s)" in msg


def test_write_refuses_an_inconsistent_adapter(tmp_path):
    cfg = pf.AdapterConfig(r=2, lora_alpha=4)
    bad = {
        "a": {pf.LORA_A: np.zeros((2, 3)), pf.LORA_B: np.zeros((5, 3)), pf.MAGNITUDE: np.ones(5)}
    }
    with pytest.raises(pf.AdapterFormatError, match="rank mismatch"):
        pf.write_adapter(tmp_path / "out", pf.Adapter(cfg, bad))
    assert not (tmp_path / "out").exists()
