"""Zero-copy tensor bridge between PyTorch and JAX through DLPack.

``torch_to_jax`` and ``jax_to_torch`` share the buffer (no copy) when the producer's
memory can be handed over as is: same device, dense row-major layout, and on CPU
an alignment JAX accepts (PyTorch's allocator gives one). Otherwise DLPack
consumers copy. A shared buffer means aliasing: a later in-place change to the
torch tensor shows through the JAX array, which JAX assumes immutable — take
``jnp.array(x)`` (a copy) when the torch side may still change the tensor.

64-bit tensors follow JAX's canonicalisation: with ``jax_enable_x64`` off (the
default) an int64/float64 tensor arrives as int32/float32, which is a copy.

Torch is imported lazily, so ``dora_jax`` does not depend on it.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np


def torch_to_jax(tensor) -> jax.Array:
    """A torch tensor (any device DLPack can share) → a JAX array on the same device.

    Detaches first (DLPack refuses tensors that require grad) and makes the tensor
    contiguous (a copy only if it was not). Same shape and dtype (bf16 included).
    """
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return jax.dlpack.from_dlpack(t)


def jax_to_torch(array: jax.Array):
    """A JAX array → a torch tensor sharing its buffer (same device, shape, dtype)."""
    import torch

    if not isinstance(array, jax.Array):
        raise TypeError(f"array must be a jax.Array; got {type(array).__name__}")
    return torch.from_dlpack(array)


def as_jax(x) -> jax.Array:
    """Any tensor-like (torch tensor, NumPy or JAX array) → a JAX array.

    Torch tensors go through ``torch_to_jax`` (zero-copy), NumPy arrays through
    ``jnp.asarray``. Torch is looked up in ``sys.modules``: if it was never imported,
    ``x`` cannot be a torch tensor.
    """
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch_to_jax(x)
    raise TypeError(f"expected a torch tensor, NumPy or JAX array; got {type(x).__name__}")
