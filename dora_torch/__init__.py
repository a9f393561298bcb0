"""dora_torch — DoRA for PyTorch with a factored norm and fused Triton kernels.

Ladder (Liger style): ``kernels/`` (Triton kernels + launchers) → ``ops`` (one autograd
Function, traced by torch.compile) → ``functional.dora_linear`` (dispatch, norm, caches) →
``Linear`` / ``accelerate_peft`` / ``inject``. ``kernels/launch`` starts the Triton kernels of
eager calls; ``norm_group`` recomputes a model's norms after each update with one CUDA-graph
replay. Beside it: ``scalora`` (ScaLoRA) and ``distributed`` (FSDP2, tensor parallelism;
imported explicitly).
"""

from . import functional
from .cache import clear_caches
from .compose import compose, compose_dropout, magnitude_scale
from .config import EPS
from .dispatch import resolve_impl
from .functional import dora_linear
from .interop import (
    AccelerationReport,
    accelerate_peft,
    inject,
    load_adapter,
    restore_peft,
    save_adapter,
)
from .layer import Linear, scaling_for
from .merge import merge_weight, unmerge_weight
from .norm import base_sq_norm, factored_norm
from .norm_group import group_norms
from .scalora import ScaLoRA

__all__ = [
    "EPS",
    "AccelerationReport",
    "Linear",
    "ScaLoRA",
    "accelerate_peft",
    "base_sq_norm",
    "clear_caches",
    "compose",
    "compose_dropout",
    "dora_linear",
    "factored_norm",
    "functional",
    "group_norms",
    "inject",
    "load_adapter",
    "magnitude_scale",
    "merge_weight",
    "resolve_impl",
    "restore_peft",
    "save_adapter",
    "scaling_for",
    "unmerge_weight",
]
