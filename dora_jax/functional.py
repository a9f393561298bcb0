"""``dora_dense``: the DoRA layer as a pure function of arrays (Flax layout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .checks import (
    check_adapter,
    check_chunk_size,
    check_dropout,
    check_floating,
    check_input,
    check_scaling,
    check_vector,
)
from .config import OPS, current_platform, resolve_impl
from .vjp import Options, dora_core


def dora_dense(
    x,
    kernel,
    lora_a,
    lora_b,
    magnitude,
    scaling,
    bias=None,
    *,
    impl: str = "auto",
    exact_norm_grad: bool = False,
    norm=None,
    base_sq=None,
    chunk_size: int | None = None,
    interpret: bool | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    deterministic: bool = True,
    norm_sharding=None,
):
    """DoRA dense layer ``y = g ⊙ (x·K + s·(x·a)·b) + bias``, g = m / max(||K + s·a·b||_col, eps).

    Args:
      x: [..., d_in], any leading dims (including none-sized ones); sets the activation dtype.
      kernel: [d_in, d_out] frozen base weight (cast to x's dtype if it differs).
      lora_a: [d_in, r]. lora_b: [r, d_out]. magnitude: [d_out]. bias: [d_out] or None.
        Adapters may be f32 (PEFT's default over a 16-bit kernel): they are cast to the
        activation dtype for the products, which accumulate in acc = promote_types(f32, x's
        dtype); their gradients come back in their own dtypes.
      scaling: the adapter scale s (a Python number: alpha / r, or alpha / sqrt(r)).
      impl: "xla", "mosaic" (the Mosaic GPU compose and backward scale-and-reduce where they
        take the shape and dtype, XLA elsewhere), or "auto" (the measured ``AUTO_MOSAIC`` table
        in ``dora_jax.config``, with one Hopper GPU in the process).
      exact_norm_grad: differentiate through the norm too (default: norm detached, as in the
        DoRA paper and PEFT).
      norm: optional precomputed column norm [d_out] (e.g. cached for inference with frozen
        adapters); treated as a constant. Cannot be combined with ``exact_norm_grad``.
      base_sq: optional precomputed ``||K_:j||²`` [d_out] (K is frozen, so it can be cached).
      chunk_size: accumulate the norm's GEMMs over slices of d_in.
      interpret: run the Mosaic kernels in Pallas' GPU interpreter (default: when not on a
        GPU).
      norm_sharding: a ``dora_jax.sharding.NormSharding`` (the kernel's spec on a mesh): the
        norm then runs as a ``shard_map`` (``sharded_norm_parts``); None (default): the plain
        factored norm, which XLA partitions itself.
      dropout_rate, dropout_rng, deterministic: adapter dropout with PEFT's semantics
        (docs/design.md §1). Active only when ``dropout_rate > 0`` and ``deterministic`` is
        False (the default True, as for an eval call, ignores the rate); then x_d = dropout(x)
        (mask drawn from
        ``dropout_rng`` by ``dropout_mask``, kept entries scaled by 1/(1 − rate), as
        ``nnx.Dropout``) feeds the adapter and

            y = x·K + (g − 1) ⊙ (x_d·K) + g ⊙ s·(x_d·a)·b + bias,   g − 1 = (m − n)/n in f32

        which costs a second base GEMM on x_d. That call always composes in XLA (the Mosaic
        compose has no dropout form: such a choice falls back to XLA). The norm is unaffected by
        dropout, so ``exact_norm_grad`` works as without it. Gradients reach x
        through both x and x_d. ``dropout_rate=0`` runs exactly the no-dropout program.

    Returns [..., d_out] in x's dtype. The norm, g and the composition run in acc (f32 for
    bf16/f16/f32 activations; f64 for f64 activations under ``jax_enable_x64``, where forward
    and gradients are float64-accurate), so no ``g − 1`` ever forms in the activation dtype.
    In the backward g ⊙ dy saturates at ±finfo(x.dtype).max when rounded to x's dtype (a zero
    column, n clamped to eps, would overflow f16 and turn dx into NaN), as dora_torch does.
    The Mosaic compose rounds the output once; the XLA compose first rounds
    ``inner = base + s·h·b`` to x's dtype (XLA folds the add into the LoRA GEMM) and then once
    more after the f32 scale: two roundings, measured 2.8e-3 vs 2.2e-3 relative error in bf16
    (one rounding of the exact result: 1.7e-3), within the shared tolerance rule. Works under
    jit, grad, vmap and remat.
    """
    d_in, d_out, r = check_adapter(kernel, lora_a, lora_b)
    check_input(x, d_in)
    check_vector("magnitude", magnitude, d_out)
    check_vector("bias", bias, d_out)
    check_vector("norm", norm, d_out)
    check_vector("base_sq", base_sq, d_out)
    if magnitude is None:
        raise ValueError("magnitude must be an array of shape [d_out]; got None")
    check_floating("magnitude", magnitude)
    s = check_scaling(scaling)
    chunk_size = check_chunk_size(chunk_size)
    rate = check_dropout(dropout_rate, dropout_rng, deterministic)
    if norm is not None and exact_norm_grad:
        raise ValueError(
            "norm is a precomputed constant; it cannot be combined with exact_norm_grad"
        )

    x_d = None
    if rate > 0.0 and not deterministic:
        keep = dropout_mask(dropout_rng, rate, x.shape)
        x_d = lax.select(keep, x / (1.0 - rate), jnp.zeros_like(x)).reshape(-1, d_in)

    platform = current_platform()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d_in)
    shape = (x2.shape[0], d_in, d_out, r)
    opts = Options(
        scaling=s,
        exact_norm_grad=bool(exact_norm_grad),
        compose_impl=resolve_impl(impl, "compose", platform=platform, shape=shape, dtype=x.dtype),
        interpret=(platform != "gpu") if interpret is None else bool(interpret),
        chunk_size=chunk_size,
        norm_sharding=norm_sharding,
        reduce_impl=resolve_impl(
            impl, "scale_reduce", platform=platform, shape=shape, dtype=x.dtype
        ),
    )
    kernel = kernel if kernel.dtype == x.dtype else kernel.astype(x.dtype)
    y = dora_core(opts, x2, x_d, kernel, lora_a, lora_b, magnitude, bias, base_sq, norm)
    return y.reshape(*lead, d_out)


def dropout_mask(rng, rate: float, shape):
    """The keep mask (bool, True = kept) ``dora_dense`` draws for adapter dropout on an input of
    this shape: ``jax.random.bernoulli(rng, 1 − rate, shape)``, as ``nnx.Dropout`` does."""
    return jax.random.bernoulli(rng, 1.0 - rate, shape)


def resolved_impls(
    x_shape, kernel_shape, rank: int, *, impl: str = "auto", dtype=jnp.bfloat16
) -> dict[str, str]:
    """What ``impl`` resolves to per op for these shapes and activation dtype on the current
    backend (for logs)."""
    d_in, d_out = kernel_shape
    tokens = 1
    for d in x_shape[:-1]:
        tokens *= int(d)
    shape = (tokens, d_in, d_out, int(rank))
    platform = current_platform()
    return {op: resolve_impl(impl, op, platform=platform, shape=shape, dtype=dtype) for op in OPS}
