"""Folding the adapter into the kernel and undoing it (Flax layout), the one place with this math.

    merged = g ⊙_cols (K + s·a·b),   K = merged / g − s·a·b,   g = m / max(n, eps)

n is the norm of the UNMERGED kernel; it cannot be read back from the merged one, so
``unmerge_weight`` takes the n saved at merge time (``DoraDense.merge`` keeps it). The names
and argument order follow ``dora_torch.merge_weight`` / ``unmerge_weight``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .checks import check_adapter, check_scaling, check_vector
from .config import acc_dtype
from .norm import factored_norm
from .xla_ops import magnitude_scale


def _prepare(kernel, lora_a, lora_b, magnitude, scaling, norm):
    _, d_out, _ = check_adapter(kernel, lora_a, lora_b)
    check_vector("magnitude", magnitude, d_out)
    if magnitude is None:
        raise ValueError("magnitude must be an array of shape [d_out]; got None")
    check_vector("norm", norm, d_out)
    s = check_scaling(scaling)
    acc = acc_dtype(kernel.dtype, lora_a.dtype, lora_b.dtype)
    # the dense s·a·b once, at full precision in acc (merging is a one-off; no TF32 on the GPU)
    delta = s * jnp.dot(lora_a.astype(acc), lora_b.astype(acc), precision=lax.Precision.HIGHEST)
    return s, acc, delta


def merge_weight(kernel, lora_a, lora_b, magnitude, scaling, norm=None, *, dtype=None):
    """``g ⊙_cols (K + s·a·b)`` with g = m / max(n, eps): the kernel with the adapter folded in.

    kernel [d_in, d_out], lora_a [d_in, r], lora_b [r, d_out], magnitude [d_out]; ``norm``
    [d_out] the column norm of the unmerged K + s·a·b (default: ``factored_norm`` of these
    arrays, the norm the forward uses). Computed in promote(f32, kernel, adapters) (it builds
    the dense [d_in, d_out] product once, by design) and returned in ``dtype`` (default: the
    kernel's). ``x·merge_weight(...) + bias`` equals ``dora_dense(x, ...)``.
    """
    s, acc, delta = _prepare(kernel, lora_a, lora_b, magnitude, scaling, norm)
    if norm is None:
        norm = factored_norm(kernel, lora_a, lora_b, s)
    g = magnitude_scale(magnitude, norm, acc)
    w = kernel.astype(acc) + delta
    return (w * g[None, :]).astype(kernel.dtype if dtype is None else dtype)


def unmerge_weight(merged, lora_a, lora_b, magnitude, scaling, norm, *, dtype=None):
    """Inverse of ``merge_weight``: ``merged / g − s·a·b`` with g = m / max(norm, eps).

    ``norm`` [d_out] must be the norm used when merging (that of the unmerged kernel). Raises
    ValueError if a column has g = 0 (m = 0), which merging cannot undo (checked when the
    values are concrete, i.e. outside jit). Returned in ``dtype`` (default: merged's).
    """
    if norm is None:
        raise ValueError("norm (the column norm saved at merge time) is required to unmerge")
    _, acc, delta = _prepare(merged, lora_a, lora_b, magnitude, scaling, norm)
    g = magnitude_scale(magnitude, norm, acc)
    try:
        g_host = np.asarray(g)
    except jax.errors.TracerArrayConversionError:  # under jit: no check
        g_host = None
    if g_host is not None:
        zero = np.flatnonzero(g_host == 0)
        if zero.size:
            raise ValueError(
                "cannot unmerge columns with zero magnitude (m == 0), e.g. columns "
                f"{zero[:8].tolist()}"
            )
    w = merged.astype(acc) / g[None, :] - delta
    return w.astype(merged.dtype if dtype is None else dtype)


def merged_kernel(kernel, lora_a, lora_b, magnitude, scaling, *, norm=None, dtype=None):
    """Deprecated alias of ``merge_weight`` (dora_torch's name); removed after one release."""
    warnings.warn(
        "dora_jax.merged_kernel is deprecated; use dora_jax.merge_weight",
        DeprecationWarning,
        stacklevel=2,
    )
    return merge_weight(kernel, lora_a, lora_b, magnitude, scaling, norm, dtype=dtype)
