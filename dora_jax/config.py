"""Every tunable of the JAX backend in one place: Pallas block sizes and the ``impl="auto"`` table.

Block sizes are powers of two (Triton needs power-of-two array shapes inside a kernel) and every
block that feeds a dot is at least 16 wide (``plt.dot`` with a contraction or output dimension
below 16 is wrong or refused on the GPU, DESIGN §7). Kernels mask edge blocks, so shapes need
not be multiples of the blocks.

``AUTO_PALLAS`` is the decision table behind ``impl="auto"``: an op runs as Pallas only on the
shape class where ``benchmarks/bench_jax_layer`` measured it faster than XLA on the H200
(``benchmarks/results/jax_layer.csv``); XLA everywhere else.
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


@dataclass(frozen=True)
class BlockConfig:
    """Block sizes and launch parameters of the three Pallas kernels (``dora_jax.kernels``).

    compose:      grid over (tokens / compose_block_t, d_out / compose_block_n); the LoRA product
                  h·b is accumulated over the rank in slices of ``compose_block_r``.
    scale_reduce: grid over (reduce_splits, d_out / reduce_block_n); each program walks its share
                  of the tokens in steps of ``reduce_block_t`` and writes one partial column sum.
    norm:         grid over d_out / norm_block_n; G·b is accumulated in ``norm_block_r`` slices.
    """

    compose_block_t: int = 64
    compose_block_n: int = 128
    compose_block_r: int = 32
    compose_num_warps: int = 4
    reduce_block_t: int = 32
    reduce_block_n: int = 128
    reduce_splits: int = 16
    reduce_num_warps: int = 4
    norm_block_n: int = 64
    norm_block_r: int = 32
    norm_num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name, v in vars(self).items():
            if name.endswith("_warps") or name in ("num_stages", "reduce_splits"):
                if int(v) < 1:
                    raise ValueError(f"{name} must be positive; got {v!r}")
                continue
            if not _is_pow2(int(v)):
                raise ValueError(f"{name} must be a power of two; got {v!r}")
            if name in ("compose_block_t", "compose_block_n", "compose_block_r") and v < 16:
                raise ValueError(f"{name} feeds a dot and must be >= 16; got {v!r}")
            if name in ("norm_block_n", "norm_block_r") and v < 16:
                raise ValueError(f"{name} feeds a dot and must be >= 16; got {v!r}")


DEFAULT_BLOCKS = BlockConfig()


def dot_precision(compute_dtype) -> lax.Precision:
    """Precision of the small f32 dots (G·b of the norm, h·b in f32 compose).

    With f32 activations the caller asked for f32 accuracy: use IEEE f32 (HIGHEST), since GPU
    dots default to TF32 (~2⁻¹¹ relative error). With bf16/f16 activations TF32 is 16× below
    the activation rounding, so keep the fast default.
    """
    return (
        lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else lax.Precision.DEFAULT
    )


# A predicate sees the layer shape (tokens, d_in, d_out, rank) and returns True where Pallas
# was measured faster than XLA on the GPU. None means "XLA on every shape".
ShapePredicate = Callable[[int, int, int, int], bool]

AUTO_PALLAS: Mapping[str, ShapePredicate | None] = MappingProxyType(
    {
        "norm": None,  # norm assembly from U = aᵀK and G = aᵀa
        # y = g ⊙ (base + s·h b) + bias. Run 7: at 512 tokens (4096², r = 384, norm frozen, the
        # only Pallas op in that forward) 0.103 ms vs XLA's 0.148 (jnp LoRA 0.107). At 4096
        # tokens Pallas (all three ops) was 0-14% slower, so larger batches stay on XLA.
        "compose": lambda tokens, d_in, d_out, rank: tokens <= 512,
        "scale_reduce": None,  # dy_g = g ⊙ dy and Σ_t dy ⊙ saved
    }
)

IMPLS = ("auto", "pallas", "xla")
OPS = tuple(AUTO_PALLAS)


def current_platform() -> str:
    """The platform new computations land on: the ``jax.default_device`` in effect if one is
    set (e.g. the CPU twin of a GPU run), else the default backend ("cpu", "gpu", "tpu")."""
    dev = jax.config.jax_default_device
    if dev is None:
        return jax.default_backend()
    return dev if isinstance(dev, str) else dev.platform


def resolve_impl(impl: str, op: str, *, platform: str, shape: tuple[int, int, int, int]) -> str:
    """ "pallas" or "xla" for one op; ``impl="auto"`` reads ``AUTO_PALLAS`` (GPU only)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if op not in AUTO_PALLAS:
        raise ValueError(f"op must be one of {OPS}; got {op!r}")
    if impl != "auto":
        return impl
    rule = AUTO_PALLAS[op]
    if platform != "gpu" or rule is None:
        return "xla"
    return "pallas" if rule(*shape) else "xla"
