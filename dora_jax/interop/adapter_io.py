"""PEFT-format adapter files for Flax nnx models holding ``dora_jax.DoraDense`` layers.

Module paths. A PEFT file names modules by their path in the PyTorch base model
(``model.layers.0.self_attn.q_proj``); an nnx model has its own paths (tuples such
as ``("model", "layers", 0, "self_attn", "q_proj")``). ``key_map`` maps the first to
the second: ``{peft_path: nnx_path}``, an nnx path given as a tuple or as its
dot-joined string. The default (``key_map=None``) is the identity on dot-joined
paths, which is right for ``dora_jax.models.llama`` (it mirrors transformers'
Llama names) and any nnx model that names its attributes like the torch model.
A custom ``key_map`` must list every adapted module (it is inverted for saving).

Layouts. Files hold PyTorch layout (A [r, d_in], B [d_out, r]); DoraDense holds
Flax layout (lora_a [d_in, r], lora_b [r, d_out]); the conversion is
``shared_spec.to_flax_layout`` / ``from_flax_layout``, the one place layouts change.
Values are copied bit for bit when dtypes agree, so PEFT → file → jax → file → PEFT
is exact.

Names. ``save_adapter`` / ``load_adapter`` are ``dora_torch``'s names; the earlier
``save_peft_adapter`` / ``load_peft_adapter`` remain as deprecated aliases.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shared_spec import from_flax_layout, to_flax_layout
from shared_spec import peft_format as pf

NnxPath = tuple[str, ...]


def _norm_path(path) -> NnxPath:
    """An nnx path (tuple with ints, or dot-joined string) in one comparable form."""
    parts = path.split(".") if isinstance(path, str) else path
    return tuple(str(p) for p in parts)


def _modules(model, cls) -> dict[NnxPath, object]:
    return {_norm_path(p): m for p, m in nnx.iter_graph(model) if isinstance(m, cls)}


def _dora_cls():
    from ..dense import DoraDense

    return DoraDense


# The one mapping between PEFT tensor names and DoraDense attributes, both ways.
def _shape_only(array) -> np.ndarray:
    """A free stand-in with ``array``'s shape (a broadcast view: the frozen kernel, possibly
    gigabytes on an accelerator, is never copied to the host just for layout checks)."""
    return np.broadcast_to(np.zeros((), np.float32), tuple(array.shape))


def _to_peft(layer) -> dict[str, np.ndarray]:
    """A DoraDense's adapter as PEFT tensors (PyTorch layout, NumPy, same dtypes)."""
    kernel = _shape_only(layer.kernel.get_value())
    _, A, B = from_flax_layout(
        kernel, np.asarray(layer.lora_a.get_value()), np.asarray(layer.lora_b.get_value())
    )
    return {pf.LORA_A: A, pf.LORA_B: B, pf.MAGNITUDE: np.asarray(layer.magnitude.get_value())}


def _from_peft(layer, t: Mapping[str, np.ndarray]) -> list[tuple[nnx.Variable, np.ndarray]]:
    """PEFT tensors → [(DoraDense variable, value in Flax layout)]."""
    if pf.BASE_WEIGHT in t:
        W = t[pf.BASE_WEIGHT]
    else:  # only its shape is needed
        W = np.swapaxes(_shape_only(layer.kernel.get_value()), 0, 1)
    kernel, lora_a, lora_b = to_flax_layout(W, t[pf.LORA_A], t[pf.LORA_B])
    out = [(layer.lora_a, lora_a), (layer.lora_b, lora_b), (layer.magnitude, t[pf.MAGNITUDE])]
    if pf.BASE_WEIGHT in t:  # PEFT saved the base layer too (lm_head, ...): load it, as PEFT does
        out.append((layer.kernel, kernel))
    if pf.BASE_BIAS in t:
        out.append((layer.bias, t[pf.BASE_BIAS]))
    return out


def _spec(layer) -> pf.LayerSpec:
    d_in, d_out = layer.kernel.get_value().shape
    return pf.LayerSpec(
        d_out, d_in, r=layer.r, scaling=layer.scaling, has_bias=layer.bias is not None
    )


def _peft_paths(nnx_paths, key_map) -> tuple[dict[NnxPath, str], list[str]]:
    """nnx path → PEFT path for ``nnx_paths``, and the paths ``key_map`` cannot name."""
    if key_map is None:
        return {p: ".".join(p) for p in nnx_paths}, []
    inverse = {_norm_path(v): k for k, v in key_map.items()}
    unmapped = [".".join(p) for p in nnx_paths if p not in inverse]
    return {p: inverse[p] for p in nnx_paths if p in inverse}, unmapped


def _nnx_path(peft_path: str, key_map) -> NnxPath | None:
    if key_map is None:
        return _norm_path(peft_path)
    return _norm_path(key_map[peft_path]) if peft_path in key_map else None


def save_adapter(model, path, *, key_map: Mapping[str, object] | None = None) -> None:
    """Write every ``DoraDense`` of nnx ``model`` as a PEFT DoRA adapter directory.

    The result loads with ``peft.PeftModel.from_pretrained`` into the torch model the
    PEFT paths name (and with ``load_adapter`` / ``dora_torch.load_adapter``).
    ``lora_dropout`` is the layers' rate. ValueError if there is no DoraDense, a
    DoraDense ``key_map`` does not name, a mix of rsLoRA and plain layers or of
    dropout rates (PEFT's config has one flag and one rate), a bare ``DoraDense`` as
    ``model`` (PEFT names tensors by module path: save the model holding it), or NaN or
    inf in a tensor; nothing is written then.
    """
    layers = _modules(model, _dora_cls())
    if not layers:
        raise ValueError("model has no DoraDense layer to save (use dora_jax.inject first)")
    names, unmapped = _peft_paths(layers, key_map)
    if unmapped:
        raise ValueError(f"key_map has no PEFT path for these DoraDense layers: {unmapped}")
    rslora = {bool(layer.use_rslora) for layer in layers.values()}
    if len(rslora) != 1:
        raise ValueError("layers mix use_rslora=True and False; PEFT's config has one flag")
    adapted = list(names.values())
    if key_map is None:
        candidates = [".".join(p) for p in _modules(model, nnx.Module)]
        target_modules = pf.target_modules_for(adapted, candidates)
    else:  # other torch modules are unknown here: select exactly the adapted paths
        target_modules = pf.exact_target_modules(adapted)
    config = pf.config_for_layers(
        {names[p]: (layer.r, layer.lora_alpha) for p, layer in layers.items()},
        use_rslora=rslora.pop(),
        target_modules=target_modules,
        lora_dropout=pf.common_dropout(
            {names[p]: layer.lora_dropout for p, layer in layers.items()}
        ),
    )
    tensors = {names[p]: _to_peft(layer) for p, layer in layers.items()}
    pf.write_adapter(path, pf.Adapter(config, tensors))


def load_adapter(model, path, *, key_map: Mapping[str, object] | None = None, adapter_dtype=None):
    """Load a PEFT DoRA adapter directory into nnx ``model``, in place; returns ``model``.

    If ``model`` has ``DoraDense`` layers, the file must cover exactly those, with
    their ranks and scales. If it has none, the ``nnx.Linear`` layers the file names
    are first wrapped as ``dora_jax.inject`` does, with the file's ranks, alphas, rsLoRA
    and ``lora_dropout`` (active until ``model.eval()``, as nnx.Dropout), and
    ``adapter_dtype`` (None: PEFT's rule, the kernel's dtype but float32 over a
    float16/bfloat16 kernel; ignored when the model has DoraDense layers). Values are cast
    to the layers' parameter dtypes and keep their shardings. All problems (NaN or inf
    values included) are reported in one ``shared_spec.peft_format.AdapterFormatError``
    (a ValueError) before anything is written.
    """
    adapter = pf.read_adapter(path)
    where = f"adapter at {path}"
    nnx_of = {p: _nnx_path(p, key_map) for p in adapter.tensors}
    unnamed = sorted(p for p, q in nnx_of.items() if q is None)
    if unnamed:
        raise pf.AdapterFormatError(where, [f"key_map has no entry for {p}" for p in unnamed])
    layers = _modules(model, _dora_cls())
    if layers:
        names, unmapped = _peft_paths(layers, key_map)
        if unmapped:
            raise pf.AdapterFormatError(
                where, [f"key_map has no PEFT path for DoraDense {p}" for p in unmapped]
            )
        pf.validate_against(adapter, {names[p]: _spec(m) for p, m in layers.items()}, where=where)
    else:
        linears = {_norm_path(q): (q, m) for q, m in nnx.iter_graph(model)
                   if q and isinstance(m, nnx.Linear)}  # fmt: skip
        targets = {p: linears[q] for p, q in nnx_of.items() if q in linears}
        specs = {p: pf.LayerSpec(*m.kernel.get_value().shape[::-1], has_bias=m.bias is not None)
                 for p, (_, m) in targets.items()}  # fmt: skip
        pf.validate_against(adapter, specs, where=f"{where} (no nnx.Linear for extras)")
        from ..inject import inject_from_config

        inject_from_config(
            model,
            adapter.config,
            [(q, m, p) for p, (q, m) in targets.items()],
            rngs=nnx.Rngs(0),  # lora_a's random init is overwritten by the file's values
            lora_dropout=adapter.config.lora_dropout,
            adapter_dtype=adapter_dtype,
        )
        layers = _modules(model, _dora_cls())
        names, _ = _peft_paths(layers, {p: nnx_of[p] for p in targets})
    updates = [
        u for p, layer in layers.items() for u in _from_peft(layer, adapter.tensors[names[p]])
    ]
    for var, value in updates:
        old = var.get_value()
        var.set_value(jax.device_put(jnp.asarray(value, dtype=old.dtype), old.sharding))
    for layer in layers.values():
        layer.clear_cache()  # a frozen norm belongs to the old adapter
    return model


def save_peft_adapter(model, path, *, key_map: Mapping[str, object] | None = None) -> None:
    """Deprecated alias of ``save_adapter`` (dora_torch's name)."""
    warnings.warn(
        "save_peft_adapter is deprecated; use dora_jax.save_adapter (same arguments)",
        DeprecationWarning,
        stacklevel=2,
    )
    save_adapter(model, path, key_map=key_map)


def load_peft_adapter(model, path, *, key_map: Mapping[str, object] | None = None):
    """Deprecated alias of ``load_adapter`` (dora_torch's name)."""
    warnings.warn(
        "load_peft_adapter is deprecated; use dora_jax.load_adapter (same arguments)",
        DeprecationWarning,
        stacklevel=2,
    )
    return load_adapter(model, path, key_map=key_map)
