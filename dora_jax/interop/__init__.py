"""Interop for dora_jax: PEFT-format adapter files and the torch ⇄ JAX DLPack bridge.

save_adapter(model, path, key_map=None) / load_adapter(model, path, key_map=None)
    (save_peft_adapter / load_peft_adapter: deprecated aliases)
torch_to_jax(tensor) / jax_to_torch(array)      zero-copy through DLPack
"""

from .adapter_io import load_adapter, load_peft_adapter, save_adapter, save_peft_adapter
from .dlpack import jax_to_torch, torch_to_jax

__all__ = [
    "jax_to_torch",
    "load_adapter",
    "load_peft_adapter",
    "save_adapter",
    "save_peft_adapter",
    "torch_to_jax",
]
