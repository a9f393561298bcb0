"""``inject``: replace nnx.Linear layers of a model by DoraDense layers wrapping them."""

from __future__ import annotations

import re
from collections.abc import Callable

from flax import nnx

from .dense import DoraDense


def _path_str(path) -> str:
    return "/".join(str(p) for p in path)


def inject(
    model: nnx.Module,
    *,
    target: str | re.Pattern | Callable[[str, nnx.Linear], bool],
    rank: int,
    alpha: float,
    rngs: nnx.Rngs,
    **dora_kwargs,
) -> list[str]:
    """Wrap every ``nnx.Linear`` in ``model`` whose path matches ``target``, in place.

    Args:
      model: any nnx graph (modules, nnx.List/Dict containers).
      target: a regex searched in the "/"-joined path (e.g. ``r"attn/(q|v)_proj$"``), or a
        predicate ``(path, linear) -> bool``.
      rank, alpha, rngs, **dora_kwargs: passed to ``DoraDense.from_linear`` (impl,
        exact_norm_grad, adapter_dtype, lora_dropout, deterministic, ...).

    Returns the paths replaced, in graph order. Raises ValueError if nothing matched.
    """
    if isinstance(target, str | re.Pattern):
        pattern = re.compile(target)

        def matches(path: str, _linear) -> bool:
            return pattern.search(path) is not None
    elif callable(target):
        matches = target
    else:
        raise ValueError(f"target must be a regex or a predicate; got {type(target).__name__}")

    found = [
        (path, node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Linear) and path and matches(_path_str(path), node)
    ]
    if not found:
        raise ValueError(f"target {target!r} matched no nnx.Linear in {type(model).__name__}")
    for path, linear in found:
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        dora = DoraDense.from_linear(linear, rank=rank, alpha=alpha, rngs=rngs, **dora_kwargs)
        if isinstance(path[-1], int):
            parent[path[-1]] = dora
        else:
            setattr(parent, path[-1], dora)
    return [_path_str(p) for p, _ in found]
