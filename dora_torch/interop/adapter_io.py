"""PEFT-format adapter files for models holding ``dora_torch.Linear`` layers.

``save_adapter`` writes ``adapter_config.json`` + ``adapter_model.safetensors`` that
``peft.PeftModel.from_pretrained`` loads into the same base model (module paths are
the model's ``named_modules`` names, e.g. ``model.layers.0.self_attn.q_proj`` for a
transformers ``LlamaForCausalLM``). ``load_adapter`` reads such a file — written by
PEFT, by this module or by ``dora_jax`` — and validates every tensor against the
model before writing any of them; on error the model is unchanged.

Tensors cross to NumPy (the format layer's currency) without changing dtype:
bfloat16 goes through a bit-level view (``ml_dtypes``), so round trips are bit-exact.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shared_spec import peft_format as pf

from .inject import _adapter_params, dora_layers, inject_from_config


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU NumPy copy of ``t`` in the same dtype (bfloat16 as ``ml_dtypes.bfloat16``)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return t.numpy().copy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """Inverse of ``to_numpy`` (CPU tensor)."""
    a = np.ascontiguousarray(a)
    if np.issubdtype(a.dtype, np.number):
        return torch.from_numpy(a)
    import ml_dtypes  # anything else the format layer accepts is ml_dtypes.bfloat16

    if a.dtype != ml_dtypes.bfloat16:
        raise TypeError(f"cannot convert a NumPy array of dtype {a.dtype} to torch")
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def _hparams(layer) -> tuple[int, float]:
    return layer.r, layer.lora_alpha


def _name_or_path(model: nn.Module) -> str | None:
    """A transformers model's ``config._name_or_path`` (PEFT records it), else None."""
    return getattr(getattr(model, "config", None), "_name_or_path", None) or None


def save_adapter(model: nn.Module, path) -> None:
    """Write every ``dora_torch.Linear`` of ``model`` as a PEFT DoRA adapter directory.

    Per-layer ranks and alphas become ``rank_pattern``/``alpha_pattern``; the
    ``target_modules`` written select exactly the adapted layers; ``lora_dropout`` is
    the layers' rate. ValueError if the model has no DoRA layer, mixes rsLoRA and plain
    layers or different dropout rates (PEFT's config has one flag and one rate), or is
    itself a bare ``dora_torch.Linear`` (PEFT names tensors by module path: save the
    model holding it), and if any tensor holds NaN or inf; nothing is written then.
    """
    layers = dora_layers(model)
    if not layers:
        raise ValueError("model has no dora_torch.Linear layer to save (use inject first)")
    rslora = {layer.use_rslora for layer in layers.values()}
    if len(rslora) != 1:
        raise ValueError("layers mix use_rslora=True and False; PEFT's config has one flag")
    dropout = pf.common_dropout({p: layer.lora_dropout for p, layer in layers.items()})
    candidates = [name for name, _ in model.named_modules()]
    config = pf.config_for_layers(
        {p: _hparams(layer) for p, layer in layers.items()},
        use_rslora=rslora.pop(),
        target_modules=pf.target_modules_for(layers, candidates),
        lora_dropout=dropout,
        extra={"base_model_name_or_path": _name_or_path(model)},
    )
    tensors = {
        p: {name: to_numpy(t) for name, t in _adapter_params(layer).items()}
        for p, layer in layers.items()
    }
    pf.write_adapter(path, pf.Adapter(config, tensors))


def load_adapter(model: nn.Module, path, *, adapter_dtype: torch.dtype | None = None) -> nn.Module:
    """Load a PEFT DoRA adapter directory into ``model``, in place; returns ``model``.

    If ``model`` already has ``dora_torch.Linear`` layers, the file must cover exactly
    those layers with their ranks and scales. If it has none, the layers the file
    names are adapted first (``inject`` with the file's ranks, alphas, rsLoRA and
    dropout, and ``adapter_dtype``: None is PEFT's rule, the base layer's dtype but
    fp32 on fp16/bf16 bases) — so a PEFT adapter loads into a plain transformers
    model in one call. Tensors are cast to the layers' parameter dtypes. Every problem
    (file or fit, NaN or inf values included) is reported in one
    ``shared_spec.peft_format.AdapterFormatError`` (a ValueError) before anything is
    written.
    """
    adapter = pf.read_adapter(path)
    layers = dora_layers(model)
    if layers:
        specs = {
            p: pf.LayerSpec(
                layer.out_features,
                layer.in_features,
                r=layer.r,
                scaling=layer.scaling,
                has_bias=layer.bias is not None,
            )
            for p, layer in layers.items()
        }
        pf.validate_against(adapter, specs, where=f"adapter at {path}")
    else:
        linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
        targets = {p: linears[p] for p in adapter.tensors if p in linears}
        specs = {p: pf.LayerSpec(*m.weight.shape, has_bias=m.bias is not None)
                 for p, m in targets.items()}  # fmt: skip
        pf.validate_against(adapter, specs, where=f"adapter at {path} (no nn.Linear for extras)")
        inject_from_config(
            model,
            adapter.config,
            targets,
            lora_dropout=adapter.config.lora_dropout,
            freeze_base=True,
            adapter_dtype=adapter_dtype,
        )
        layers = dora_layers(model)
    with torch.no_grad():
        for p, layer in layers.items():
            params = {
                **_adapter_params(layer),
                pf.BASE_WEIGHT: layer.weight,
                pf.BASE_BIAS: layer.bias,
            }
            for name, value in adapter.tensors[p].items():  # base_layer.* too, as PEFT does
                params[name].copy_(from_numpy(value))
    return model
