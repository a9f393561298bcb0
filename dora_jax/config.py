"""Every tunable of the JAX backend in one place: Mosaic GPU tiles and the ``impl="auto"`` table.

``AUTO_MOSAIC`` is the decision table behind ``impl="auto"``: an op runs its Mosaic GPU kernel
only on the shape class where the H200 measured it faster than XLA (``benchmarks/ab_jax``,
``bench_jax_layer``), and only with one Hopper GPU in the process; XLA everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import jax
import jax.numpy as jnp
from jax import lax


def _is_pow2(v: int) -> bool:
    return v >= 1 and (v & (v - 1)) == 0


@dataclass(frozen=True, kw_only=True)
class MosaicConfig:
    """Tiles of the Mosaic GPU kernels (``dora_jax.mosaic``).

    scale_reduce, swiglu: the backward's cotangent passes of one layer
             (``mosaic.scale_reduce``) and of a SwiGLU pair (``mosaic.swiglu_backward``), one
             [*_tile_m, *_tile_n] tile per program (a smaller tile_m where the token count
             needs one; 64 at least), its arithmetic in slabs of ``*_chunk_m`` rows (None:
             the whole tile; a multiple of 64 up to tile_m), which bounds the registers a
             thread needs by the slab instead of the tile.
    compose: grid over (tokens / compose_tile_m, d_out / compose_tile_n), one warpgroup per
             program; the rank is walked by ``emit_pipeline`` with up to
             ``compose_max_concurrent_steps`` TMA copies in flight, and
             ``compose_wgmma_in_flight`` (0 or 1) wgmma steps left running while the next one
             is issued (1 delays the release of each step's SMEM by one step, so it needs at
             least 2 concurrent steps). A wgmma accumulator has 64-row granules and TMA's
             swizzled tiles 64 columns of 16-bit values, hence the multiples of 64.
    """

    compose_tile_m: int = 64
    compose_tile_n: int = 128
    compose_max_concurrent_steps: int = 2
    compose_wgmma_in_flight: int = 0
    scale_reduce_tile_m: int = 64
    scale_reduce_tile_n: int = 128
    swiglu_tile_m: int = 256
    swiglu_tile_n: int = 32
    scale_reduce_chunk_m: int | None = None
    swiglu_chunk_m: int | None = None

    def __post_init__(self):
        for name in ("compose_tile_m", "compose_tile_n", "scale_reduce_tile_m", "swiglu_tile_m"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 64 or v % 64 or not _is_pow2(v):
                raise ValueError(f"{name} must be a power of two and a multiple of 64; got {v!r}")
        for name in ("scale_reduce_tile_n", "swiglu_tile_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v > 128 or not _is_pow2(v):
                raise ValueError(f"{name} must be a power of two from 16 to 128; got {v!r}")
        for op in ("scale_reduce", "swiglu"):
            v, tile = getattr(self, f"{op}_chunk_m"), getattr(self, f"{op}_tile_m")
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 64 or not _is_pow2(v):
                raise ValueError(f"{op}_chunk_m must be None or a power of two >= 64; got {v!r}")
            if v > tile:
                raise ValueError(f"{op}_chunk_m={v} must not exceed {op}_tile_m={tile}")
        v = self.compose_max_concurrent_steps
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"compose_max_concurrent_steps must be a positive int; got {v!r}")
        w = self.compose_wgmma_in_flight
        if w not in (0, 1) or isinstance(w, bool):
            raise ValueError(f"compose_wgmma_in_flight must be 0 or 1; got {w!r}")
        if w >= v:
            raise ValueError(
                f"compose_wgmma_in_flight={w} needs compose_max_concurrent_steps > {w}; got {v}"
            )


DEFAULT_MOSAIC = MosaicConfig()


def acc_dtype(*dtypes) -> jnp.dtype:
    """The accumulation / elementwise dtype for arrays of these dtypes: ``promote_types(f32, …)``.

    f32 for bf16, f16 and f32 inputs; f64 for f64 inputs (only with ``jax_enable_x64``). Every
    "f32" of the JAX backend (norms, g, the composition, the backward's sums) means this dtype.
    """
    out = jnp.dtype(jnp.float32)
    for dt in dtypes:
        out = jnp.promote_types(out, jnp.dtype(dt))
    return out


def default_adapter_dtype(kernel_dtype) -> jnp.dtype:
    """PEFT's rule (``autocast_adapter_dtype=True``) for lora_a, lora_b and magnitude: the base
    kernel's dtype, except float32 over a float16/bfloat16 kernel."""
    dt = jnp.dtype(kernel_dtype)
    return jnp.dtype(jnp.float32) if dt in (jnp.float16, jnp.bfloat16) else dt


def dot_precision(compute_dtype) -> lax.Precision:
    """Precision of the small accumulation-dtype dots in the composition (h·b).

    With f32 (or f64) activations the caller asked for full accuracy: use HIGHEST, since GPU
    f32 dots default to TF32 (~2⁻¹¹ relative error). With bf16/f16 activations TF32 is 16×
    below the activation rounding, so keep the fast default.
    """
    full = jnp.dtype(compute_dtype) in (jnp.float32, jnp.float64)
    return lax.Precision.HIGHEST if full else lax.Precision.DEFAULT


#: Precision of the norm's G·b: lora_b enters the assembly at promote(b.dtype, f32) and is
#: never rounded down (no TF32 on the GPU), whatever the activation dtype (the adapter
#: precision rule shared with dora_torch). Layers with a 16-bit kernel form it from bf16 pairs
#: instead (``NORM_GEMM_BF16X3``).
NORM_PRECISION = lax.Precision.HIGHEST

#: On GPUs, form the norm's G·b from bf16 pairs on the tensor cores (``xla_ops.gram_times_b``)
#: for a layer whose kernel is bf16 or f16 and whose assembly is f32: within 3·2⁻¹⁶ of the
#: exact product per entry, where the HIGHEST-precision f32 GEMM runs on the CUDA cores
#: (benchmarks/NOTES.md, session 22). Elsewhere the f32 product is as fast, and kept. The name
#: and the rule are dora_torch's (``config.NORM_GEMM_BF16X3``). Read when the norm is traced.
NORM_GEMM_BF16X3 = True


def norm_gemm_bf16x3(kernel_dtype, assembly_dtype) -> bool:
    """Whether the norm of a layer with this kernel dtype, traced now, forms G·b as bf16x3."""
    return (
        NORM_GEMM_BF16X3
        and jnp.dtype(kernel_dtype) in (jnp.bfloat16, jnp.float16)
        and jnp.dtype(assembly_dtype) == jnp.float32
        and current_platform() == "gpu"
    )


#: The eigensolver of ScaLoRA's 2r × 2r systems on GPUs: "qr" (cuSOLVER's batched syev at
#: every size) or "jax" (JAX's choice: batched Jacobi ``syevj`` for 2r ≤ 32). Read when
#: ``scalora_update`` is traced; ``benchmarks/bench_scalora_jax.py`` compares the two.
SCALORA_EIGH_ON_GPU = "qr"

#: Rows of K merged per step of ScaLoRA's merge loop (``scalora.merge_scaled``): the f32 product
#: a·diag(c)·b exists one [rows, d_out] block at a time, so a merge over a whole model holds
#: O(rows · d_out) of temporaries instead of one f32 [d_in, d_out] per layer. Rows, not an
#: element budget as in dora_torch (``SCALORA_MERGE_ELEMS``): eager torch merges one layer
#: at a time anyway, while under jit only the loop orders the layers' products, so every
#: layer taller than a block must take it (benchmarks/NOTES.md, session 10). Read when the
#: merge is traced.
SCALORA_MERGE_ROWS = 1024


# A predicate sees the layer shape (tokens, d_in, d_out, rank) and returns True where the
# Mosaic kernel was measured faster than XLA on the GPU. None means "XLA on every shape".
ShapePredicate = Callable[[int, int, int, int], bool]


def _every_shape(tokens: int, d_in: int, d_out: int, rank: int) -> bool:
    """Every shape the kernel takes (``_mosaic_takes`` checks that first)."""
    return True


#: Ops with a Mosaic GPU kernel (``dora_jax.mosaic``), and where ``impl="auto"`` picks it with
#: one Hopper GPU in the process (``_one_hopper``). No entry until the H200 measures it faster
#: than the alternative in one process (``benchmarks/ab_jax``): None = never chosen by "auto".
#: - compose: None. XLA's compose is never slower in training since the base product's
#:   barriers (run 108); in inference (a frozen norm) the kernel ties it within ±3% on most
#:   Llama-8B shapes and trails it by up to 1.8× on a few (runs 140-141).
#: - swiglu: every shape. The 8-layer Llama-8B step, one process, fused against unfused:
#:   r = 16 −0.44 ms, r = 384 −0.52 ms at batch 1 × 2048, r = 16 −1.40 ms at batch 4 × 2048
#:   (run 115, benchmarks/NOTES.md session 27).
#: - scale_reduce: every shape. The same step with each layer's scale-and-reduce as the kernel
#:   against XLA's pass: r = 384 −0.98 ms, r = 16 batch 4 −1.35 ms (runs 122-123; r = 16 batch
#:   1 −0.33 ms, inside the ±0.4 ms an A/A moves, run 125; benchmarks/NOTES.md session 28).
AUTO_MOSAIC: Mapping[str, ShapePredicate | None] = MappingProxyType(
    {"compose": None, "scale_reduce": _every_shape, "swiglu": _every_shape}
)

IMPLS = ("auto", "xla", "mosaic")
#: The ops an impl is resolved for: norm assembly from U = aᵀK and G = aᵀa; the compose
#: y = g ⊙ (base + s·h·b) + bias; scale_reduce, dy_g = g ⊙ dy and Σ_t dy ⊙ saved; swiglu, the
#: scale_reduce of a SwiGLU pair of layers with the activation's derivative (``dora_jax.swiglu``).
OPS = ("norm", "compose", "scale_reduce", "swiglu")


def current_platform() -> str:
    """The platform new computations land on: the ``jax.default_device`` in effect if one is
    set (e.g. the CPU twin of a GPU run), else the default backend ("cpu", "gpu", "tpu")."""
    dev = jax.config.jax_default_device
    if dev is None:
        return jax.default_backend()
    return dev if isinstance(dev, str) else dev.platform


def _mosaic_takes(op: str, shape: tuple[int, int, int, int], dtype) -> bool:
    """Whether ``dora_jax.mosaic`` has a kernel for this op, shape and activation dtype."""
    from . import mosaic

    supported = {
        "compose": mosaic.compose_supported,
        "scale_reduce": mosaic.scale_reduce_supported,
        "swiglu": mosaic.swiglu_supported,
    }.get(op)
    if supported is None or dtype is None:
        return False
    tokens, _, d_out, _ = shape
    return supported(tokens, d_out, dtype)


def _one_hopper() -> bool:
    """The process sees exactly one GPU, a Hopper (sm90), where the Mosaic kernels' wgmma and
    TMA exist. One, because XLA's SPMD partitioner does not partition a Mosaic custom call: in
    a program sharded over several devices by ``jax.jit`` its operands would be all-gathered
    to every device (correct, but slower than the XLA path it replaces), and the kernels were
    measured on one GPU only. Inside ``shard_map`` each device would run the kernel on its own
    shard under ``impl="mosaic"`` (not yet run on several GPUs)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend
        return False
    return len(gpus) == 1 and str(getattr(gpus[0], "compute_capability", "")).startswith("9.")


def check_impl(impl) -> str:
    """``impl`` if it is one of ``IMPLS``; else a ValueError naming the valid values."""
    if isinstance(impl, str) and impl in IMPLS:
        return impl
    msg = f"impl must be one of {IMPLS}; got {impl!r}"
    if impl == "pallas":
        msg += ' (the Triton-backend Pallas kernels were removed: use "xla" or "mosaic")'
    raise ValueError(msg)


def resolve_impl(
    impl: str, op: str, *, platform: str, shape: tuple[int, int, int, int], dtype=None
) -> str:
    """ "mosaic" or "xla" for one op on a layer of ``shape`` = (tokens, d_in, d_out, rank) with
    activations of ``dtype``.

    "mosaic" runs the op's Mosaic GPU kernel where one exists for the shape and dtype
    (``dora_jax.mosaic``) and XLA elsewhere; "auto" runs it where ``AUTO_MOSAIC`` says so in a
    process that sees one GPU, a Hopper (``_one_hopper``), else XLA.
    """
    check_impl(impl)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}; got {op!r}")
    if impl == "mosaic":
        return "mosaic" if _mosaic_takes(op, shape, dtype) else "xla"
    if impl == "xla" or platform != "gpu":
        return "xla"
    rule = AUTO_MOSAIC.get(op)
    if rule is not None and _mosaic_takes(op, shape, dtype) and _one_hopper() and rule(*shape):
        return "mosaic"
    return "xla"
