"""The factored DoRA weight norm in Flax layout (docs/design.md §2), without the dense a·b.

For each output column j of the effective kernel K + s·a·b (norm over d_in):

    n_j² = ||K_:j||²                    base_sq (K frozen: callers may cache it)
         + 2s · Σ_k b_kj U_kj            U = aᵀK  [r, d_out]   (one XLA GEMM)
         + s² · Σ_kl b_kj G_kl b_lj      G = aᵀa  [r, r]

The adapter precision rule (shared with dora_torch): lora_a is rounded to the kernel's dtype,
the dtype it meets the kernel in for U = aᵀK, and G = aᵀa is formed from the same rounded a;
both accumulate in acc = promote_types(f32, kernel dtype). lora_b enters the assembly at
promote(b.dtype, f32), never rounded down to the kernel's dtype. The assembly runs in
promote(acc, that): f32 for bf16/f16/f32 kernels with f32 adapters, f64 when anything is f64
(with ``jax_enable_x64``). With a bf16/f16 kernel, G·b runs on the tensor cores from bf16 pairs
(``config.NORM_GEMM_BF16X3``, ``xla_ops.gram_times_b``), within 3·2⁻¹⁶ of the f32 product.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import xla_ops
from .checks import check_adapter, check_chunk_size, check_scaling, check_vector
from .config import NORM_PRECISION, acc_dtype, check_impl, norm_gemm_bf16x3

# contract axis 0 of both operands: aᵀK and aᵀa without materialising a transpose
_CONTRACT_0 = (((0,), (0,)), ((), ()))


def base_sq_norm(kernel, *, chunk_size=None):
    """``||K_:j||²`` per output column [d_out] in promote(f32, kernel dtype); kernel
    [d_in, d_out] any float dtype."""
    if jnp.ndim(kernel) != 2:
        raise ValueError(f"kernel must be 2-D [d_in, d_out]; got shape {jnp.shape(kernel)}")
    acc = acc_dtype(kernel.dtype)
    total = None
    for sl in chunk_slices(kernel.shape[0], check_chunk_size(chunk_size)):
        part = jnp.sum(jnp.square(kernel[sl].astype(acc)), axis=0)
        total = part if total is None else total + part
    return total


def norm_gemms(kernel, lora_a, *, chunk_size=None):
    """(U = aᵀK [r, d_out], G = aᵀa [r, r]) in promote(f32, kernel dtype); a is rounded to the
    kernel's dtype (for both GEMMs: G is the Gram of the very a that meets K).

    With ``chunk_size`` both are accumulated over slices of d_in, bounding the transient of
    each GEMM's operands.

    G reads a through an optimization barrier: U and G would otherwise share the operand aᵀ,
    and XLA's GPU dot merger would run them as one GEMM aᵀ·[K | a] over a copy of the
    kernel made on every call (benchmarks/NOTES.md, session 24; ``vjp._base_product``).
    """
    acc = acc_dtype(kernel.dtype)
    a = lora_a.astype(kernel.dtype)
    u = gram = None
    for sl in chunk_slices(kernel.shape[0], check_chunk_size(chunk_size)):
        du = lax.dot_general(a[sl], kernel[sl], _CONTRACT_0, preferred_element_type=acc)
        a_g = lax.optimization_barrier(a[sl])
        dg = lax.dot_general(a_g, a_g, _CONTRACT_0, preferred_element_type=acc)
        u, gram = (du, dg) if u is None else (u + du, gram + dg)
    return u, gram


def factored_norm(
    kernel,
    lora_a,
    lora_b,
    scaling,
    *,
    base_sq=None,
    chunk_size=None,
    impl: str = "auto",
):
    """Column norms of ``kernel + s·lora_a·lora_b`` (Flax layout), [d_out].

    Args:
      kernel: [d_in, d_out]. lora_a: [d_in, r]. lora_b: [r, d_out]. scaling: s (a number).
      base_sq: optional precomputed ``||kernel_:j||²`` [d_out] (see ``base_sq_norm``).
      chunk_size: accumulate the GEMMs over slices of d_in of this width.
      impl: "auto", "xla" or "mosaic", checked; every impl assembles the norm in XLA (there is
        no Mosaic norm kernel).

    Precision (the rule shared with dora_torch): lora_a is rounded to the kernel's dtype for
    U = aᵀK and G = aᵀa, which accumulate in promote(f32, kernel dtype); lora_b enters the
    assembly at promote(b.dtype, f32). The result's dtype is promote(f32, kernel, lora_b):
    f32 for bf16/f16/f32 inputs, f64 for f64 inputs (with ``jax_enable_x64``). Never forms the
    dense [d_in, d_out] product a·b.
    """
    _, d_out, _ = check_adapter(kernel, lora_a, lora_b)
    s = check_scaling(scaling)
    check_vector("base_sq", base_sq, d_out)
    check_impl(impl)
    n, _ = norm_parts(kernel, lora_a, lora_b, base_sq, scaling=s, chunk_size=chunk_size)
    return n


def norm_parts(
    kernel,
    lora_a,
    lora_b,
    base_sq,
    *,
    scaling,
    chunk_size,
    grad_parts: bool = False,
):
    """(n, w): the factored norm, and with ``grad_parts`` w = s·U + s²·G·b [r, d_out].

    w is the one product the exact norm gradient needs from the norm (db += c ⊙ w); it is
    returned instead of U and G so the backward neither keeps them nor recomputes G·b.
    The one implementation behind ``factored_norm`` and the custom_vjp's forward; arguments
    already checked.
    """
    u, gram = norm_gemms(kernel, lora_a, chunk_size=chunk_size)
    if base_sq is None:
        base_sq = base_sq_norm(kernel, chunk_size=chunk_size)
    return assemble_parts(
        u, gram, lora_b, base_sq, kernel_dtype=kernel.dtype, scaling=scaling, grad_parts=grad_parts
    )


def assemble_parts(u, gram, lora_b, base_sq, *, kernel_dtype, scaling, grad_parts):
    """(n, w or None) from U, G, b and ‖K‖², in XLA, and with ``grad_parts`` w = s·U + s²·G·b.
    Shared by ``norm_parts`` and the sharded norm (``dora_jax.sharding``), which only differ in
    where U, G and ‖K‖² come from. The assembly runs in promote(f32, kernel, b) (b never
    rounded down to the kernel's dtype); G·b as bf16x3 where ``config.norm_gemm_bf16x3``
    says so (a 16-bit kernel)."""
    dt = acc_dtype(kernel_dtype, lora_b.dtype)
    split = norm_gemm_bf16x3(kernel_dtype, dt)
    u, gram, base_sq = (v.astype(dt) for v in (u, gram, base_sq))
    gb = xla_ops.gram_times_b(gram, lora_b, precision=NORM_PRECISION, bf16x3=split)
    b = lora_b.astype(dt)
    n = xla_ops.norm_from_gb(u, gb, b, base_sq, scaling=scaling)
    w = scaling * u + scaling * scaling * gb if grad_parts else None
    return n, w


def chunk_slices(n: int, chunk: int | None) -> list[slice]:
    """Slices of ``range(n)`` of width ``chunk`` (one slice when None; one empty slice when
    n = 0): the one chunking helper of dora_jax."""
    step = n if chunk is None else chunk
    return [slice(i, min(i + step, n)) for i in range(0, max(n, 1), max(step, 1))]
