"""dora_jax — DoRA for JAX/Flax with a factored norm and a Mosaic GPU compose kernel.

Layout is Flax's: kernel [d_in, d_out], lora_a [d_in, r], lora_b [r, d_out], magnitude [d_out]
(``shared_spec.layout`` converts to and from PyTorch's). The vocabulary is PEFT's and
``dora_torch``'s: r, lora_alpha, use_rslora, lora_dropout.

    factored_norm(kernel, lora_a, lora_b, scaling)   column norms of K + s·a·b [d_out]
    functional.dora_dense(x, kernel, ...)            the layer as a jax.custom_vjp
    DoraDense(d_in, d_out, r=..., lora_alpha=..., rngs=...) / DoraDense.from_linear(linear, ...)
                                                     the nnx layer; DoraParam its trainable type;
                                                     merge()/unmerge() fold the adapter into the
                                                     kernel in place, to_linear() returns a new
                                                     merged nnx.Linear
    linen.DoraDense(features, r=..., lora_alpha=...) the linen twin
    merge_weight / unmerge_weight                    fold the adapter into a kernel and back
    inject(model, target_modules=..., r=..., lora_alpha=..., rngs=...)
                                                     wrap matching nnx.Linear layers
    save_adapter / load_adapter                      adapter files in PEFT's format
    swiglu(gate, up, x)                              silu(gate(x)) · up(x); for two DoRA layers
                                                     one backward pass (a Mosaic GPU kernel)

Precision: the norm, g and the composition run in promote_types(float32, compute dtype):
float32 for bfloat16/float16/float32 activations, float64 for float64 ones (with
``jax_enable_x64``). Adapters default to PEFT's dtype rule: the kernel's dtype, float32 over a
float16/bfloat16 kernel.

Deprecated for one release (a DeprecationWarning names the replacement): the keywords
``rank``/``alpha`` (now ``r``/``lora_alpha``), ``merged_kernel`` (now ``merge_weight``) and
``save_peft_adapter``/``load_peft_adapter`` (now ``save_adapter``/``load_adapter``).
``DoraDense.merge()`` used to return a new nnx.Linear; that is now ``to_linear()``.
"""

from . import functional, linen, scalora, sharding
from .dense import DoraCache, DoraDense, DoraParam
from .functional import dora_dense
from .inject import inject
from .interop import load_adapter, load_peft_adapter, save_adapter, save_peft_adapter
from .merge import merge_weight, merged_kernel, unmerge_weight
from .norm import base_sq_norm, factored_norm
from .scalora import scalora_step, scalora_update
from .swiglu import swiglu

__all__ = [
    "DoraCache",
    "DoraDense",
    "DoraParam",
    "base_sq_norm",
    "dora_dense",
    "factored_norm",
    "functional",
    "inject",
    "linen",
    "load_adapter",
    "load_peft_adapter",
    "merge_weight",
    "merged_kernel",
    "save_adapter",
    "save_peft_adapter",
    "scalora",
    "scalora_step",
    "scalora_update",
    "sharding",
    "swiglu",
    "unmerge_weight",
]
