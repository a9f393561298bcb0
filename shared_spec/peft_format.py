"""Hugging Face PEFT's on-disk DoRA adapter format, framework-free (NumPy only).

A PEFT adapter is a directory holding

- ``adapter_config.json``: ``r``, ``lora_alpha``, ``use_rslora``, ``use_dora``,
  ``target_modules``, ``rank_pattern``, ``alpha_pattern``, ``lora_dropout``, ... ;
- ``adapter_model.safetensors``: for every adapted module ``<path>`` (its name in
  the *base* model, e.g. ``model.layers.0.self_attn.q_proj``) three tensors,
  PyTorch layout, keyed by the full PEFT names:

      base_model.model.<path>.lora_A.weight          [r, d_in]
      base_model.model.<path>.lora_B.weight          [d_out, r]
      base_model.model.<path>.lora_magnitude_vector  [d_out]

Both backends read and write adapters only through this module, so key naming,
pattern semantics and validation live in one place. Tensors here are NumPy arrays
(bfloat16 through ``ml_dtypes``, as ``safetensors.numpy`` does); ``safetensors`` is
imported lazily so the spec package itself needs only NumPy.

``rank_pattern``/``alpha_pattern`` follow PEFT exactly (``peft.utils.other.get_pattern_key``):
the keys are regular expressions tried in insertion order, a key matches a module
path when ``re.match(rf"(.*\\.)?({key})$", path)`` succeeds, and the first match wins;
otherwise ``r``/``lora_alpha`` apply. ``target_modules`` follows
``peft.tuners.tuners_utils.check_target_module_exists``: a string is a regex that
must ``fullmatch`` the path; a list matches a path equal to an entry or ending in
``"." + entry``.

Errors: everything wrong with a file (unreadable JSON or safetensors, ``use_dora``
false, unknown keys, missing or mis-shaped tensors, NaN or inf values, ranks that
disagree with the config, empty module paths) and with a file/model pairing (modules
missing on either side, shapes, ranks or scales that disagree) is collected and raised
as ONE ``AdapterFormatError`` listing every problem, before any caller writes anything
into a model (or any writer writes a file).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .initialization import scaling_for

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."

# The one table of PEFT tensor names. Logical name (also dora_torch.Linear's
# attribute name) → key suffix in the safetensors file.
LORA_A = "lora_A"
LORA_B = "lora_B"
MAGNITUDE = "lora_magnitude_vector"
TENSOR_SUFFIXES: dict[str, str] = {
    LORA_A: "lora_A.weight",
    LORA_B: "lora_B.weight",
    MAGNITUDE: "lora_magnitude_vector",
}
# Optional: PEFT also saves the frozen base weight of a targeted embedding-like layer
# (``lm_head``, ``embed_tokens``; ``save_embedding_layers="auto"``). Loaders write it
# into the base layer, as PEFT does; savers omit it.
BASE_WEIGHT = "base_layer.weight"
BASE_BIAS = "base_layer.bias"
BASE_SUFFIXES: dict[str, str] = {BASE_WEIGHT: BASE_WEIGHT, BASE_BIAS: BASE_BIAS}
_ALL_SUFFIXES = {**TENSOR_SUFFIXES, **BASE_SUFFIXES}

# Config fields this module interprets; every other field of a read config is kept
# in ``AdapterConfig.extra`` and written back unchanged.
_KNOWN_FIELDS = (
    "peft_type",
    "r",
    "lora_alpha",
    "use_rslora",
    "use_dora",
    "target_modules",
    "rank_pattern",
    "alpha_pattern",
    "lora_dropout",
)
# Relative tolerance when comparing a file's adapter scale with a model layer's.
_SCALE_RTOL = 1e-6


class AdapterFormatError(ValueError):
    """An adapter file, or a file/model pairing, is invalid; ``problems`` lists every issue."""

    def __init__(self, where: str, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{where}: {len(self.problems)} problem(s):\n{lines}")


# ----------------------------------------------------------------------------- matching


def pattern_key(patterns: Iterable[str], path: str) -> str | None:
    """The first key of ``patterns`` matching module ``path`` in PEFT's sense, or None."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", path):
            return key
    return None


def matches_target(target_modules: str | Iterable[str], path: str) -> bool:
    """Whether PEFT's ``target_modules`` selects the module at ``path``."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, path) is not None
    targets = list(target_modules)
    return path in targets or any(path.endswith(f".{t}") for t in targets)


def target_modules_for(adapted: Iterable[str], candidates: Iterable[str]) -> list[str] | str:
    """A ``target_modules`` value selecting exactly ``adapted`` among ``candidates``.

    Prefers PEFT's common form, the sorted list of last path components (``["q_proj",
    "v_proj"]``), when it selects exactly the adapted paths among ``candidates`` (every
    module path of the base model); otherwise returns a regex fully matching each
    adapted path, so PEFT never adapts a module the file has no tensors for.
    """
    adapted = sorted(set(adapted))
    if not adapted:
        raise ValueError("adapted must name at least one module path")
    suffixes = sorted({p.rsplit(".", 1)[-1] for p in adapted})
    selected = {p for p in set(candidates) | set(adapted) if matches_target(suffixes, p)}
    if selected == set(adapted):
        return suffixes
    return exact_target_modules(adapted)


def exact_target_modules(adapted: Iterable[str]) -> str:
    """A ``target_modules`` regex that selects exactly the module paths ``adapted``."""
    adapted = sorted(set(adapted))
    if not adapted:
        raise ValueError("adapted must name at least one module path")
    return "(?:" + "|".join(re.escape(p) for p in adapted) + ")"


# ------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` a DoRA adapter needs, plus the rest verbatim."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: list[str] | str | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    lora_dropout: float = 0.0
    use_dora: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def rank(self, path: str) -> int:
        """The rank PEFT gives the module at ``path`` (``rank_pattern`` first, then ``r``)."""
        key = pattern_key(self.rank_pattern, path)
        return int(self.r if key is None else self.rank_pattern[key])

    def alpha(self, path: str) -> float:
        """The ``lora_alpha`` PEFT gives the module at ``path``."""
        key = pattern_key(self.alpha_pattern, path)
        return self.lora_alpha if key is None else self.alpha_pattern[key]

    def scaling(self, path: str) -> float:
        """The adapter scale s of the module at ``path`` (``alpha/r`` or ``alpha/sqrt(r)``)."""
        return scaling_for(self.rank(path), self.alpha(path), self.use_rslora)

    def to_json_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        d.update(
            peft_type="LORA",
            r=self.r,
            lora_alpha=self.lora_alpha,
            use_rslora=self.use_rslora,
            use_dora=self.use_dora,
            target_modules=self.target_modules,
            rank_pattern=dict(self.rank_pattern),
            alpha_pattern=dict(self.alpha_pattern),
            lora_dropout=self.lora_dropout,
        )
        d.setdefault("bias", "none")
        d.setdefault("fan_in_fan_out", False)
        d.setdefault("task_type", None)
        return dict(sorted(d.items()))


def config_from_json_dict(d: Mapping[str, Any], problems: list[str]) -> AdapterConfig | None:
    """Parse a config dict; append what is wrong to ``problems`` (None if unusable)."""
    before = len(problems)
    if d.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {d.get('peft_type')!r}; only 'LORA' (with use_dora) is DoRA")
    if d.get("use_dora") is not True:
        problems.append(f"use_dora is {d.get('use_dora')!r}; a DoRA adapter needs use_dora: true")
    if d.get("fan_in_fan_out", False):
        problems.append("fan_in_fan_out is true (Conv1D layout); only nn.Linear layout works")
    r = d.get("r")
    if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
        problems.append(f"r must be a positive integer; got {r!r}")
    alpha = d.get("lora_alpha")
    if not _is_number(alpha):
        problems.append(f"lora_alpha must be a number; got {alpha!r}")
    patterns = {}
    for name, check in (("rank_pattern", _is_rank), ("alpha_pattern", _is_number)):
        p = d.get(name) or {}
        if not isinstance(p, dict):
            problems.append(f"{name} must be a JSON object; got {p!r}")
            p = {}
        for key, value in p.items():
            if not check(value):
                problems.append(f"{name}[{key!r}] = {value!r} is not a valid value")
            try:
                re.compile(key)
            except re.error as e:
                problems.append(f"{name} key {key!r} is not a valid regex: {e}")
        patterns[name] = p
    if len(problems) > before:
        return None
    return AdapterConfig(
        r=r,
        lora_alpha=alpha,
        use_rslora=bool(d.get("use_rslora", False)),
        target_modules=d.get("target_modules"),
        rank_pattern=patterns["rank_pattern"],
        alpha_pattern=patterns["alpha_pattern"],
        lora_dropout=float(d.get("lora_dropout", 0.0) or 0.0),
        use_dora=True,
        extra={k: v for k, v in d.items() if k not in _KNOWN_FIELDS},
    )


def common_dropout(rates: Mapping[str, float]) -> float:
    """The one ``lora_dropout`` of the layers ``rates`` {module path: rate}.

    PEFT's config has a single ``lora_dropout`` for every module (no per-module
    pattern), so layers with different rates cannot be written faithfully:
    ValueError naming the layers of each rate instead of keeping only one of them.
    """
    if not rates:
        raise ValueError("rates must contain at least one adapted module")
    groups: dict[float, list[str]] = {}
    for path, rate in sorted(rates.items()):
        groups.setdefault(float(rate), []).append(path)
    if len(groups) == 1:
        return next(iter(groups))
    listed = "; ".join(
        f"lora_dropout={rate:g}: {_some(paths)}"
        for rate, paths in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    )
    raise ValueError(
        f"the DoRA layers have different lora_dropout rates ({listed}); PEFT's "
        "adapter_config.json has one lora_dropout for all modules, so the file could not "
        "record them: give every layer the same rate before saving"
    )


def _some(paths: list[str], limit: int = 8) -> str:
    shown = ", ".join(p or "''" for p in paths[:limit])
    return shown if len(paths) <= limit else f"{shown} and {len(paths) - limit} more"


def config_for_layers(
    layers: Mapping[str, tuple[int, float]],
    *,
    use_rslora: bool,
    target_modules: list[str] | str,
    lora_dropout: float = 0.0,
    extra: Mapping[str, Any] | None = None,
) -> AdapterConfig:
    """A config reproducing each module's ``(r, lora_alpha)`` from ``layers`` {path: (r, alpha)}.

    The most common rank and alpha become ``r``/``lora_alpha``; every other module
    gets an exact ``rank_pattern``/``alpha_pattern`` entry (its escaped full path).
    """
    if not layers:
        raise ValueError("layers must contain at least one adapted module")
    r0 = Counter(r for r, _ in layers.values()).most_common(1)[0][0]
    a0 = Counter(a for _, a in layers.values()).most_common(1)[0][0]
    rank_pattern = {re.escape(p): r for p, (r, _) in sorted(layers.items()) if r != r0}
    alpha_pattern = {re.escape(p): a for p, (_, a) in sorted(layers.items()) if a != a0}
    return AdapterConfig(
        r=int(r0),
        lora_alpha=a0,
        use_rslora=bool(use_rslora),
        target_modules=target_modules,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        lora_dropout=float(lora_dropout),
        extra=dict(extra or {}),
    )


# ------------------------------------------------------------------------------ tensors


def tensor_key(path: str, name: str) -> str:
    """PEFT's safetensors key for tensor ``name`` (``lora_A`` etc.) of module ``path``."""
    return f"{KEY_PREFIX}{path}.{_ALL_SUFFIXES[name]}"


def parse_tensor_key(key: str) -> tuple[str, str] | None:
    """``(module path, tensor name)`` for a PEFT DoRA key, or None if it is not one."""
    if not key.startswith(KEY_PREFIX):
        return None
    rest = key[len(KEY_PREFIX) :]
    for name, suffix in _ALL_SUFFIXES.items():
        if rest.endswith("." + suffix) and len(rest) > len(suffix) + 1:
            return rest[: -len(suffix) - 1], name
    return None


@dataclass
class Adapter:
    """An adapter in memory: its config and, per module path, a dict with ``lora_A``,
    ``lora_B`` and ``lora_magnitude_vector`` as NumPy arrays in PyTorch layout
    (A [r, d_in], B [d_out, r], m [d_out]), and optionally the base layer's
    ``base_layer.weight`` [d_out, d_in] / ``base_layer.bias`` [d_out]."""

    config: AdapterConfig
    tensors: dict[str, dict[str, np.ndarray]]


@dataclass(frozen=True)
class LayerSpec:
    """What a model offers at one module path, for validation.

    d_out, d_in: the frozen base weight's shape (PyTorch layout). r, scaling: an
    existing DoRA layer's rank and scale, which the file must match; None for a
    plain linear layer the loader will adapt with the file's rank and scale.
    has_bias: whether the base layer has a bias (a file's ``base_layer.bias`` needs one).
    """

    d_out: int
    d_in: int
    r: int | None = None
    scaling: float | None = None
    has_bias: bool | None = None  # None: not checked


def _path_problem(path: str) -> str | None:
    """Why ``path`` cannot name a module in a PEFT file, or None if it can."""
    if path == "":
        return (
            "module path '' is empty: the model given is itself the DoRA layer, and a bare "
            f"layer has no module name for PEFT's keys ({KEY_PREFIX}<module name>.lora_A.weight, "
            "...), so no loader could place it; save the model that contains the layer instead"
        )
    if "" in path.split("."):
        return f"module path {path!r} has an empty component (PEFT names are dot-joined names)"
    return None


def _nonfinite(a: np.ndarray) -> int:
    """How many NaN or inf values the floating-point array ``a`` holds."""
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def _check_module_tensors(path: str, t: Mapping[str, np.ndarray], problems: list[str]):
    """Internal consistency of one module's tensors; returns (d_out, d_in, r) or None."""
    bad_path = _path_problem(path)
    if bad_path is not None:
        problems.append(bad_path)
        return None
    missing = [n for n in TENSOR_SUFFIXES if n not in t]
    for n in missing:
        problems.append(f"missing key {tensor_key(path, n)}")
    if missing:
        return None
    A, B, m = t[LORA_A], t[LORA_B], t[MAGNITUDE]
    bad = False
    for n, a, nd in ((LORA_A, A, 2), (LORA_B, B, 2), (MAGNITUDE, m, 1)):
        if a.ndim != nd:
            problems.append(f"{tensor_key(path, n)} must be {nd}-D; got shape {a.shape}")
            bad = True
        elif not _is_float(a.dtype):
            problems.append(f"{tensor_key(path, n)} must be floating point; got {a.dtype}")
            bad = True
    for n in sorted(t):
        if _is_float(t[n].dtype) and (count := _nonfinite(t[n])):
            problems.append(
                f"{tensor_key(path, n)} holds {count} non-finite value(s) (NaN or inf) of "
                f"{t[n].size}"
            )
            bad = True
    if bad:
        return None
    r, d_in = A.shape
    d_out = B.shape[0]
    if B.shape[1] != r:
        problems.append(
            f"{path}: rank mismatch, lora_A {A.shape} has rank {r} "
            f"but lora_B {B.shape} has rank {B.shape[1]}"
        )
        return None
    if m.shape != (d_out,):
        problems.append(
            f"{path}: lora_magnitude_vector {m.shape} must be ({d_out},) to match lora_B {B.shape}"
        )
        return None
    for n, shape in ((BASE_WEIGHT, (d_out, d_in)), (BASE_BIAS, (d_out,))):
        if n in t and (t[n].shape != shape or not _is_float(t[n].dtype)):
            problems.append(f"{tensor_key(path, n)} is {t[n].dtype} {t[n].shape}; need {shape}")
            return None
    return d_out, d_in, r


def check_adapter(adapter: Adapter, problems: list[str]) -> None:
    """File-internal checks: every module named, complete, consistent and finite (no NaN
    or inf in any tensor), ranks as the config says. Readers and writers both run it."""
    for path in sorted(adapter.tensors):
        dims = _check_module_tensors(path, adapter.tensors[path], problems)
        if dims is not None and dims[2] != adapter.config.rank(path):
            problems.append(
                f"{path}: tensors have rank {dims[2]} but the config gives rank "
                f"{adapter.config.rank(path)} (r / rank_pattern)"
            )


def validate_against(
    adapter: Adapter, layers: Mapping[str, LayerSpec], *, where: str = "adapter"
) -> None:
    """Raise one ``AdapterFormatError`` if ``adapter`` does not fit ``layers`` exactly.

    ``layers`` maps every module path the model would adapt to its ``LayerSpec``.
    Checked: the file's internal consistency, modules missing from the file or from
    the model, shapes, and rank and scale against existing DoRA layers.
    """
    problems: list[str] = []
    check_adapter(adapter, problems)
    cfg = adapter.config
    for path in sorted(set(layers) - set(adapter.tensors)):
        problems.append(f"missing: the model adapts {path} but the file has no tensors for it")
    for path in sorted(set(adapter.tensors) - set(layers)):
        problems.append(f"extra: the file has tensors for {path}, which the model does not adapt")
    for path in sorted(set(layers) & set(adapter.tensors)):
        spec, t = layers[path], adapter.tensors[path]
        r = cfg.rank(path)
        want = {LORA_A: (r, spec.d_in), LORA_B: (spec.d_out, r), MAGNITUDE: (spec.d_out,),
                BASE_WEIGHT: (spec.d_out, spec.d_in), BASE_BIAS: (spec.d_out,)}  # fmt: skip
        for name, shape in want.items():
            if name in t and tuple(t[name].shape) != shape:
                problems.append(
                    f"shape: {tensor_key(path, name)} is {tuple(t[name].shape)}, the model needs "
                    f"{shape} (base weight [{spec.d_out}, {spec.d_in}], r={r})"
                )
        if BASE_BIAS in t and spec.has_bias is False:
            problems.append(f"bias: the file has {tensor_key(path, BASE_BIAS)}, the layer no bias")
        if spec.r is not None and spec.r != r:
            problems.append(f"rank: {path} has r={spec.r} in the model but r={r} in the file")
        if spec.scaling is not None and not math.isclose(
            spec.scaling, cfg.scaling(path), rel_tol=_SCALE_RTOL
        ):
            problems.append(
                f"scale: {path} has scaling {spec.scaling:g} in the model but the file gives "
                f"{cfg.scaling(path):g} (lora_alpha={cfg.alpha(path)}, r={r}, "
                f"use_rslora={cfg.use_rslora})"
            )
    if problems:
        raise AdapterFormatError(f"{where} does not fit the model", problems)


# ----------------------------------------------------------------------------- file I/O


def read_adapter(path) -> Adapter:
    """Read and check a PEFT adapter directory; ``AdapterFormatError`` lists every problem."""
    root = pathlib.Path(path)
    where = f"adapter at {root}"
    problems: list[str] = []
    config = None
    raw_tensors: dict[str, np.ndarray] | None = None
    if not root.is_dir():
        raise AdapterFormatError(where, [f"{root} is not a directory"])
    cfg_file, w_file = root / CONFIG_NAME, root / WEIGHTS_NAME
    if not cfg_file.is_file():
        problems.append(f"{CONFIG_NAME} is missing")
    else:
        try:
            d = json.loads(cfg_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"{CONFIG_NAME} is not valid JSON: {e}")
        else:
            if isinstance(d, dict):
                config = config_from_json_dict(d, problems)
            else:
                problems.append(f"{CONFIG_NAME} must hold a JSON object; got {type(d).__name__}")
    if not w_file.is_file():
        has_bin = (root / "adapter_model.bin").exists()
        hint = " (only safetensors is supported, not adapter_model.bin)" if has_bin else ""
        problems.append(f"{WEIGHTS_NAME} is missing{hint}")
    else:
        from safetensors.numpy import load_file

        try:
            raw_tensors = load_file(str(w_file))
        except Exception as e:  # safetensors raises several types for corrupt files
            problems.append(f"{WEIGHTS_NAME} is corrupt or unreadable: {type(e).__name__}: {e}")
    tensors: dict[str, dict[str, np.ndarray]] = {}
    for key in sorted(raw_tensors or {}):
        parsed = parse_tensor_key(key)
        if parsed is None:
            problems.append(
                f"unexpected key {key!r} (a DoRA adapter has only base_model.model.<path>."
                f"{{{', '.join(_ALL_SUFFIXES.values())}}})"
            )
            continue
        mod, name = parsed
        tensors.setdefault(mod, {})[name] = raw_tensors[key]
    if raw_tensors is not None and not raw_tensors:
        problems.append(f"{WEIGHTS_NAME} holds no tensors")
    adapter = None
    if config is not None:
        adapter = Adapter(config, tensors)
        check_adapter(adapter, problems)
    if problems:
        raise AdapterFormatError(where, problems)
    return adapter


def write_adapter(path, adapter: Adapter) -> None:
    """Write ``adapter`` as a PEFT adapter directory (created if needed).

    The adapter is checked first (``check_adapter``: what ``read_adapter`` would refuse,
    e.g. an empty module path from a bare layer or a NaN, is refused here); nothing is
    written if it is inconsistent.
    """
    problems: list[str] = []
    check_adapter(adapter, problems)
    if problems:
        raise AdapterFormatError("adapter to write", problems)
    from safetensors.numpy import save_file

    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    flat = {
        tensor_key(mod, name): np.ascontiguousarray(a)
        for mod, t in sorted(adapter.tensors.items())
        for name, a in t.items()
    }
    save_file(flat, str(root / WEIGHTS_NAME), metadata={"format": "pt"})
    (root / CONFIG_NAME).write_text(json.dumps(adapter.config.to_json_dict(), indent=2) + "\n")


def _is_float(dtype) -> bool:
    """NumPy floats, and bfloat16 (an ``ml_dtypes`` extension type NumPy does not call floating)."""
    if np.issubdtype(dtype, np.floating):
        return True
    try:
        import ml_dtypes
    except ImportError:  # then safetensors could not have produced a bfloat16 array either
        return False
    return dtype == np.dtype(ml_dtypes.bfloat16)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_rank(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1
