"""dora_jax.inject in PEFT's vocabulary: target_modules / r / lora_alpha / lora_dropout /
use_rslora / rank_pattern / alpha_pattern, PEFT's module matching, deprecated aliases."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest
from flax import nnx

from dora_jax import DoraDense
from dora_jax.inject import inject


class _Attn(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(8, 8, rngs=rngs)
        self.v_proj = nnx.Linear(8, 4, rngs=rngs)


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.self_attn = _Attn(rngs)
        self.q_proj_extra = nnx.Linear(4, 8, rngs=rngs)  # ends in "q_proj_extra", not ".q_proj"


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([_Block(rngs) for _ in range(2)])
        self.q_proj = nnx.Linear(8, 8, rngs=rngs)  # a top-level "q_proj": equal to the entry

    def __call__(self, x):
        for block in self.layers:
            x = block.q_proj_extra(block.self_attn.v_proj(block.self_attn.q_proj(x)))
        return self.q_proj(x)


def _net():
    return _Net(nnx.Rngs(0))


def _adapted(model) -> dict[str, DoraDense]:
    return {".".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, DoraDense)}


def test_target_modules_list_matches_peft_suffixes():
    model = _net()
    x = jax.random.normal(jax.random.key(1), (3, 8))
    before = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new keywords never warn
        names = inject(
            model,
            target_modules=["q_proj"],
            r=2,
            lora_alpha=6,
            use_rslora=True,
            lora_dropout=0.25,
            rngs=nnx.Rngs(1),
        )
    want = ["layers.0.self_attn.q_proj", "layers.1.self_attn.q_proj", "q_proj"]
    assert sorted(names) == want  # dot-joined PEFT names, not "layers/0/..."
    layers = _adapted(model)
    assert sorted(layers) == want  # q_proj_extra does not end in ".q_proj"
    for layer in layers.values():
        assert (layer.r, layer.lora_alpha, layer.use_rslora) == (2, 6.0, True)
        assert layer.scaling == pytest.approx(6 / 2**0.5)
        assert layer.lora_dropout == 0.25
    model.eval()  # fresh adapters reproduce the base model
    np.testing.assert_allclose(model(x), before, rtol=1e-5, atol=1e-6)


def test_target_modules_string_is_a_full_match_regex():
    model = _net()
    names = inject(model, target_modules=r"layers\.1\..*_proj", r=2, lora_alpha=2, rngs=nnx.Rngs(1))
    assert names == ["layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"]
    # a string is not a suffix list: "q_proj" fully matches only the top-level module
    assert inject(_net(), target_modules="q_proj", r=2, lora_alpha=2, rngs=nnx.Rngs(1)) == [
        "q_proj"
    ]
    with pytest.raises(ValueError, match=r"target_modules='v_proj' matches no module"):
        inject(_net(), target_modules="v_proj", r=2, lora_alpha=2, rngs=nnx.Rngs(1))


def test_rank_and_alpha_patterns_follow_peft():
    model = _net()
    inject(
        model,
        target_modules=["q_proj", "v_proj"],
        r=4,
        lora_alpha=8,
        rank_pattern={"v_proj": 2},
        alpha_pattern={r"layers\.1\.self_attn\.q_proj": 3},
        rngs=nnx.Rngs(1),
    )
    got = {n: (m.r, m.lora_alpha) for n, m in _adapted(model).items()}
    assert got == {
        "layers.0.self_attn.q_proj": (4, 8),
        "layers.0.self_attn.v_proj": (2, 8),
        "layers.1.self_attn.q_proj": (4, 3),
        "layers.1.self_attn.v_proj": (2, 8),
        "q_proj": (4, 8),
    }


def test_selecting_a_non_linear_module_is_refused_before_any_change():
    model = _net()
    with pytest.raises(ValueError, match=r"not nnx\.Linear.*layers\.0\.self_attn \(_Attn\)"):
        inject(model, target_modules=["self_attn", "q_proj"], r=2, lora_alpha=2, rngs=nnx.Rngs(1))
    assert not _adapted(model)
    inject(model, target_modules=["v_proj"], r=2, lora_alpha=2, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.v_proj \(DoraDense\)"):
        inject(model, target_modules=["v_proj"], r=2, lora_alpha=2, rngs=nnx.Rngs(1))
    with pytest.raises(TypeError, match="target_modules must be a list"):
        inject(_net(), target_modules=3, r=2, lora_alpha=2, rngs=nnx.Rngs(1))


def test_a_bad_layer_argument_leaves_the_model_unchanged():
    model = _net()
    # rank 0 for the last match only: every layer is built before any is installed
    with pytest.raises(ValueError, match="positive integer; got 0"):
        inject(
            model,
            target_modules=["q_proj"],
            r=2,
            lora_alpha=2,
            rank_pattern={r"^q_proj": 0},
            rngs=nnx.Rngs(1),
        )
    assert not _adapted(model)


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [("rank", "r", 2), ("alpha", "lora_alpha", 4.0)],
)
def test_deprecated_rank_and_alpha(old, new, value):
    kw = {"target_modules": ["v_proj"], "r": 2, "lora_alpha": 4.0}
    del kw[new]
    model = _net()
    with pytest.warns(DeprecationWarning, match=rf"'{old}' is deprecated; use '{new}'"):
        inject(model, **kw, **{old: value}, rngs=nnx.Rngs(1))
    assert all((m.r, m.lora_alpha) == (2, 4.0) for m in _adapted(model).values())
    with pytest.raises(TypeError, match=rf"both '{new}' and its deprecated alias '{old}'"):
        inject(_net(), **kw, **{new: value, old: value}, rngs=nnx.Rngs(1))


def test_deprecated_target_keeps_its_old_meaning():
    model = _net()
    with pytest.warns(DeprecationWarning, match="'target' is deprecated; use 'target_modules'"):
        names = inject(model, target=r"self_attn/q_proj$", r=2, lora_alpha=2, rngs=nnx.Rngs(1))
    assert names == ["layers/0/self_attn/q_proj", "layers/1/self_attn/q_proj"]  # searched, "/"
    with pytest.warns(DeprecationWarning):
        names = inject(_net(), target=lambda p, lin: lin.out_features == 4, rank=1, alpha=1,
                       rngs=nnx.Rngs(1))  # fmt: skip
    assert names == ["layers/0/self_attn/v_proj", "layers/1/self_attn/v_proj"]
    with pytest.raises(TypeError, match="both 'target_modules' and its deprecated alias 'target'"):
        inject(_net(), target_modules=["q_proj"], target="q_proj", r=2, lora_alpha=2,
               rngs=nnx.Rngs(1))  # fmt: skip


@pytest.mark.parametrize("missing", ["target_modules", "r", "lora_alpha"])
def test_required_keywords(missing):
    kw = {"target_modules": ["v_proj"], "r": 2, "lora_alpha": 4.0}
    del kw[missing]
    with pytest.raises(TypeError, match=f"missing required keyword argument '{missing}'"):
        inject(_net(), **kw, rngs=nnx.Rngs(1))
