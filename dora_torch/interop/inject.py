"""``inject``: turn the matching ``nn.Linear`` layers of any torch model into ``dora_torch.Linear``.

No PEFT needed. Module selection and per-module rank/alpha follow PEFT's rules
exactly (``shared_spec.peft_format``): ``target_modules`` is a list of names (a
module matches when its path equals an entry or ends with ``"." + entry``) or a
regex that must match the whole path; ``rank_pattern``/``alpha_pattern`` override
``r``/``lora_alpha`` per module. So ``inject`` on a transformers model adapts the
same layers, with the same shapes and scales, as ``get_peft_model`` with the same
``LoraConfig(use_dora=True, ...)``, and ``save_adapter`` writes what PEFT loads.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import nn

from shared_spec import peft_format as pf

from ..checks import check_module_selection, selected_modules
from ..layer import Linear
from ..norm_group import group_norms


def dora_layers(model: nn.Module) -> dict[str, Linear]:
    """Every ``dora_torch.Linear`` of ``model`` by module path (``named_modules`` order)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def _targets(model: nn.Module, target_modules) -> dict[str, nn.Linear]:
    """The modules ``target_modules`` selects; ValueError if none or if any is not nn.Linear."""
    matched = {
        name: m
        for name, m in model.named_modules()
        if name and pf.matches_target(target_modules, name)
    }
    bad = {n: type(m).__name__ for n, m in matched.items() if type(m) is not nn.Linear}
    if bad:
        listed = ", ".join(f"{n} ({t})" for n, t in bad.items())
        raise ValueError(
            f"target_modules={target_modules!r} selects modules that are not plain nn.Linear "
            f"(only those can be adapted; already adapted layers count too): {listed}"
        )
    if not matched:
        linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
        raise ValueError(
            f"target_modules={target_modules!r} matches no module; nn.Linear modules "
            f"include {linears[:8]}"
        )
    return matched


def inject(
    model: nn.Module,
    *,
    target_modules: str | Sequence[str],
    r: int,
    lora_alpha: float,
    use_rslora: bool = False,
    lora_dropout: float = 0.0,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    freeze_base: bool = True,
    adapter_dtype: torch.dtype | None = None,
    recompute_modules: str | Sequence[str] | None = None,
    stack_modules: str | Sequence[str] | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` that ``target_modules`` selects by a
    ``dora_torch.Linear`` wrapping it (weight and bias shared, not copied); in place.

    r, lora_alpha, use_rslora, lora_dropout: as in PEFT's ``LoraConfig``;
    rank_pattern/alpha_pattern: PEFT's per-module overrides (regex keys). With
    ``freeze_base`` (PEFT's behaviour) every parameter other than the adapters'
    (``lora_A``, ``lora_B``, ``lora_magnitude_vector``) stops requiring grad.
    adapter_dtype: the adapters' dtype; None (default) is PEFT's rule, applied by
    ``Linear.from_linear``: the base layer's dtype, but fp32 on fp16/bf16 bases.
    recompute_modules: None, or module names / a regex in ``target_modules``' forms, selecting
    among the adapted layers those built with ``recompute_inner=True`` (their backward
    recomputes the layer's product instead of keeping a [tokens, out_features] tensor; for
    layers whose output the next op does not keep, README "Memory (torch)").
    stack_modules (experimental): the same forms, selecting the layers built with
    ``stack_weights=True`` (W and A in one buffer: dx as one GEMM; README "Stacked
    weights").
    Everything is checked before the model is touched: ValueError if nothing
    matches, a match is not a plain ``nn.Linear``, or ``recompute_modules`` or
    ``stack_modules`` selects none of the adapted layers. Returns ``model``.
    """
    recompute_modules = check_module_selection(recompute_modules, "recompute_modules")
    stack_modules = check_module_selection(stack_modules, "stack_modules")
    config = pf.AdapterConfig(
        r=r,
        lora_alpha=lora_alpha,
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
    )
    targets = _targets(model, target_modules)
    recompute, stacked = (
        selected_modules(selection, targets, arg, "layers target_modules adapts")
        for selection, arg in ((recompute_modules, "recompute_modules"),
                               (stack_modules, "stack_modules"))
    )  # fmt: skip
    return inject_from_config(
        model,
        config,
        targets,
        lora_dropout=lora_dropout,
        freeze_base=freeze_base,
        adapter_dtype=adapter_dtype,
        recompute=recompute,
        stacked=stacked,
    )


def inject_from_config(
    model: nn.Module,
    config: pf.AdapterConfig,
    targets: Mapping[str, nn.Linear],
    *,
    lora_dropout: float,
    freeze_base: bool,
    adapter_dtype: torch.dtype | None,
    recompute: Collection[str] = (),
    stacked: Collection[str] = (),
) -> nn.Module:
    """Adapt exactly ``targets`` (path → nn.Linear) with each path's rank and alpha from
    ``config``, the paths in ``recompute`` with ``recompute_inner``, those in ``stacked``
    with ``stack_weights``. New layers are all built before the first one is installed."""
    new = {
        path: Linear.from_linear(
            lin,
            r=config.rank(path),
            lora_alpha=config.alpha(path),
            use_rslora=config.use_rslora,
            lora_dropout=lora_dropout,
            adapter_dtype=adapter_dtype,
            recompute_inner=path in recompute,
            stack_weights=path in stacked,
        )
        for path, lin in targets.items()
    }
    for path, layer in new.items():
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    group_norms(dora_layers(model).values())  # one norm recomputation per parameter update
    if freeze_base:
        adapters = {id(p) for layer in new.values() for p in _adapter_params(layer).values()}
        adapters |= {
            id(p) for layer in dora_layers(model).values() for p in _adapter_params(layer).values()
        }
        for p in model.parameters():
            if id(p) not in adapters:
                p.requires_grad_(False)
    return model


def _adapter_params(layer: Linear) -> dict[str, nn.Parameter]:
    """The one mapping of PEFT tensor names to ``dora_torch.Linear`` attributes."""
    return {
        pf.LORA_A: layer.lora_A,
        pf.LORA_B: layer.lora_B,
        pf.MAGNITUDE: layer.lora_magnitude_vector,
    }
