"""``inject``: replace nnx.Linear layers of a model by DoraDense layers wrapping them.

Vocabulary and module selection are PEFT's (``LoraConfig``), as in ``dora_torch.inject``:
a module's name is its nnx path joined with dots (``model.layers.0.self_attn.q_proj``;
``dora_jax.models.llama`` mirrors transformers' names, so the same ``target_modules``
selects the same layers in both frameworks), and ``target_modules`` is a list of names
(a module matches when its name equals an entry or ends with ``"." + entry``) or a regex
that must match the whole name (``shared_spec.peft_format.matches_target``);
``rank_pattern``/``alpha_pattern`` override ``r``/``lora_alpha`` per module.

The keywords of earlier versions, ``target`` (a regex *searched* in the "/"-joined path, or
a predicate ``(path, linear) -> bool``), ``rank`` and ``alpha``, still work with a
DeprecationWarning; ``target`` keeps its old matching and its "/"-joined return value.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from flax import nnx

from shared_spec import peft_format as pf

from .checks import renamed_argument
from .dense import DoraDense

NnxPath = tuple  # a path as nnx.iter_graph gives it: str attribute names and int indices


def _path_str(path) -> str:
    return "/".join(str(p) for p in path)


def module_name(path) -> str:
    """The PEFT-style name of the module at nnx ``path``: its parts joined with dots."""
    return ".".join(str(p) for p in path)


def _modules(model) -> list[tuple[NnxPath, nnx.Module]]:
    """Every nnx.Module below the root of ``model`` with its path, in graph order."""
    return [(p, m) for p, m in nnx.iter_graph(model) if p and isinstance(m, nnx.Module)]


def _peft_targets(model, target_modules) -> list[tuple[NnxPath, nnx.Linear]]:
    """The modules PEFT's ``target_modules`` selects; ValueError if none, or if one is not
    a plain ``nnx.Linear`` (as PEFT and ``dora_torch.inject``)."""
    if not isinstance(target_modules, str):
        if not isinstance(target_modules, Sequence | set | frozenset) or not all(
            isinstance(t, str) for t in target_modules
        ):
            raise TypeError(
                "target_modules must be a list of module names or a regex string; "
                f"got {target_modules!r}"
            )
    matched = [
        (p, m) for p, m in _modules(model) if pf.matches_target(target_modules, module_name(p))
    ]
    bad = [f"{module_name(p)} ({type(m).__name__})" for p, m in matched
           if not isinstance(m, nnx.Linear)]  # fmt: skip
    if bad:
        raise ValueError(
            f"target_modules={target_modules!r} selects modules that are not nnx.Linear (only "
            f"those can be adapted; already adapted layers count too): {', '.join(bad)}"
        )
    if not matched:
        linears = [module_name(p) for p, m in _modules(model) if isinstance(m, nnx.Linear)]
        raise ValueError(
            f"target_modules={target_modules!r} matches no module of {type(model).__name__}; "
            f"nnx.Linear modules include {linears[:8]}"
        )
    return matched


def _legacy_targets(model, target) -> list[tuple[NnxPath, nnx.Linear]]:
    """The deprecated ``target``: a regex searched in the "/"-joined path, or a predicate."""
    if isinstance(target, str | re.Pattern):
        pattern = re.compile(target)

        def matches(path: str, _linear) -> bool:
            return pattern.search(path) is not None
    elif callable(target):
        matches = target
    else:
        raise ValueError(f"target must be a regex or a predicate; got {type(target).__name__}")
    found = [
        (p, m) for p, m in _modules(model) if isinstance(m, nnx.Linear) and matches(_path_str(p), m)
    ]
    if not found:
        raise ValueError(f"target {target!r} matched no nnx.Linear in {type(model).__name__}")
    return found


def inject(
    model: nnx.Module,
    *,
    target_modules: str | Sequence[str] | None = None,
    r: int | None = None,
    lora_alpha: float | None = None,
    rngs: nnx.Rngs,
    use_rslora: bool = False,
    lora_dropout: float = 0.0,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    target: str | re.Pattern | Callable[[str, nnx.Linear], bool] | None = None,
    rank: int | None = None,
    alpha: float | None = None,
    **dora_kwargs,
) -> list[str]:
    """Wrap every ``nnx.Linear`` of ``model`` that ``target_modules`` selects in a
    ``DoraDense`` (kernel and bias Variables shared, not copied); in place.

    Args:
      model: any nnx graph (modules, nnx.List/Dict containers).
      target_modules: PEFT's: a list of module names (a module matches when its dot-joined
        path equals an entry or ends with ``"." + entry``, e.g. ``["q_proj", "v_proj"]``)
        or a regex that must match the whole dot-joined path (``r".*\\.(q|v)_proj"``).
      r, lora_alpha, use_rslora, lora_dropout: as in PEFT's ``LoraConfig``.
      rank_pattern, alpha_pattern: PEFT's per-module overrides of r / lora_alpha (regex
        keys, ``shared_spec.peft_format.pattern_key``).
      rngs: random keys for lora_a (and the dropout masks).
      **dora_kwargs: passed to ``DoraDense.from_linear`` (impl, exact_norm_grad,
        adapter_dtype, deterministic, ...).
      target, rank, alpha: deprecated aliases of target_modules (with its old meaning: a
        regex searched in the "/"-joined path, or a predicate ``(path, linear) -> bool``),
        r and lora_alpha.

    Every target is checked and every new layer built before the model is touched:
    ValueError if nothing matches or a match is not an ``nnx.Linear``. Returns the names of
    the modules replaced, in graph order (dot-joined; "/"-joined with ``target``).
    """
    r = renamed_argument("inject()", "r", r, "rank", rank)
    lora_alpha = renamed_argument("inject()", "lora_alpha", lora_alpha, "alpha", alpha)
    legacy = target is not None
    target_modules = renamed_argument(
        "inject()", "target_modules", target_modules, "target", target
    )
    if legacy:
        found = _legacy_targets(model, target_modules)
    else:
        found = _peft_targets(model, target_modules)
    config = pf.AdapterConfig(
        r=r,
        lora_alpha=lora_alpha,
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
    )
    inject_from_config(
        model,
        config,
        [(p, m, module_name(p)) for p, m in found],
        rngs=rngs,
        lora_dropout=lora_dropout,
        **dora_kwargs,
    )
    return [_path_str(p) if legacy else module_name(p) for p, _ in found]


def inject_from_config(
    model: nnx.Module,
    config: pf.AdapterConfig,
    targets: Sequence[tuple[NnxPath, nnx.Linear, str]],
    *,
    rngs: nnx.Rngs,
    lora_dropout: float,
    **dora_kwargs,
) -> None:
    """Wrap each ``(nnx path, nnx.Linear, PEFT name)`` of ``targets`` with the rank and alpha
    ``config`` gives the PEFT name. All new layers are built before the first is installed."""
    new = [
        (
            path,
            DoraDense.from_linear(
                linear,
                r=config.rank(name),
                lora_alpha=config.alpha(name),
                use_rslora=config.use_rslora,
                lora_dropout=lora_dropout,
                rngs=rngs,
                **dora_kwargs,
            ),
        )
        for path, linear, name in targets
    ]
    for path, layer in new:
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        if isinstance(path[-1], int):
            parent[path[-1]] = layer
        else:
            setattr(parent, path[-1], layer)
