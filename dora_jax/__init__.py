"""dora_jax — DoRA for JAX/Flax with a factored norm and Pallas kernels.

Layout is Flax's: kernel [d_in, d_out], lora_a [d_in, r], lora_b [r, d_out], magnitude [d_out]
(``shared_spec.layout`` converts to and from PyTorch's).

    factored_norm(kernel, lora_a, lora_b, scaling)   column norms of K + s·a·b, f32 [d_out]
    functional.dora_dense(x, kernel, ...)            the layer as a jax.custom_vjp
    DoraDense / DoraParam                            the nnx layer and its trainable Param type
    linen.DoraDense                                  the linen twin
    inject(model, target=..., rank=..., alpha=...)   wrap matching nnx.Linear layers
    save_peft_adapter / load_peft_adapter            adapter files in PEFT's format
"""

from . import functional, linen
from .config import AUTO_PALLAS, DEFAULT_BLOCKS, BlockConfig
from .dense import DoraCache, DoraDense, DoraParam
from .functional import dora_dense
from .inject import inject
from .interop import load_peft_adapter, save_peft_adapter
from .merge import merged_kernel
from .norm import base_sq_norm, factored_norm

__all__ = [
    "AUTO_PALLAS",
    "DEFAULT_BLOCKS",
    "BlockConfig",
    "DoraCache",
    "DoraDense",
    "DoraParam",
    "base_sq_norm",
    "dora_dense",
    "factored_norm",
    "functional",
    "inject",
    "linen",
    "load_peft_adapter",
    "merged_kernel",
    "save_peft_adapter",
]
