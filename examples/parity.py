"""Adapter round trips and logit agreement: our PEFT-format file → PEFT and dora_jax.

The saved directory is PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``),
so ``PeftModel.from_pretrained`` reads it unchanged; ``dora_jax`` reads the same file into the
Flax nnx Llama twin (``dora_jax.models.llama``), whose module paths mirror transformers' names.
"""

from __future__ import annotations

import copy
import os

import numpy as np


def token_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of two logit arrays per token: [..., vocab] x2 → float64 [n_tokens].

    A token where either vector is all zeros gets cosine 0 (it cannot agree in direction).
    """
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"logits must have equal shapes; got {a.shape} and {b.shape}")
    a2 = a.reshape(-1, a.shape[-1])
    b2 = b.reshape(-1, b.shape[-1])
    denom = np.linalg.norm(a2, axis=1) * np.linalg.norm(b2, axis=1)
    dots = np.sum(a2 * b2, axis=1)
    return np.where(denom > 0, dots / np.where(denom > 0, denom, 1.0), 0.0)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The worst per-token cosine similarity (NaN anywhere → NaN, which fails every check)."""
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("nan")
    return float(np.min(token_cosines(a, b)))


def peft_reload(base, path, *, device, dtype):
    """``PeftModel.from_pretrained`` on a deep copy of ``base`` moved to ``device``/``dtype``."""
    from peft import PeftModel

    work = copy.deepcopy(base).to(device=device, dtype=dtype)
    return PeftModel.from_pretrained(work, str(path)).eval()


def jax_twin_logits(hf_config, base_state_dict, path, ids: np.ndarray) -> np.ndarray:
    """Logits of the nnx Llama twin (fp32, CPU) with the adapter in ``path`` loaded by dora_jax.

    hf_config: the transformers LlamaConfig; base_state_dict: the base model's state dict
    (PyTorch layout, no adapter); ids: int [batch, seq]. Returns float64 [batch, seq, vocab].
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a GPU is torch's too
    import jax
    import jax.numpy as jnp

    from dora_jax import load_adapter
    from dora_jax.models import llama

    # On the CPU even when a GPU is there: fp32 matmuls on a GPU may run in TF32.
    with jax.default_device(jax.devices("cpu")[0]):
        model = llama.from_torch_state_dict(hf_config, base_state_dict, dtype=jnp.float32)
        load_adapter(model, str(path))  # no DoraDense yet: injects the layers it names
        return np.asarray(model(jnp.asarray(ids)), np.float64)
