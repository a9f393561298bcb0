"""shared_spec — the float64 NumPy definition of DoRA that both backends test against.

Layout is PyTorch's: W [d_out, d_in], A [r, d_in], B [d_out, r], m [d_out].
Read the modules in this order: norm, compose, linear, merge, initialization.
"""

from .compose import EPS, compose, compose_naive, magnitude_scale
from .initialization import magnitude_init, scaling_for
from .layout import from_flax_layout, to_flax_layout
from .linear import DoraGrads, dora_linear, dora_linear_vjp
from .merge import merge, unmerge
from .norm import base_sq_norm, dense_norm, factored_norm
from .scalora import (
    ScaLoRAScaling,
    column_system,
    grads_to_paper_layout,
    scalar_scaling,
    scaling_bound,
    scalora_merge,
    scalora_scaling,
    scalora_step_torch,
    to_paper_layout,
    transfer_adam_moments,
    transfer_adam_moments_torch,
)

__all__ = [
    "EPS",
    "DoraGrads",
    "ScaLoRAScaling",
    "base_sq_norm",
    "column_system",
    "compose",
    "compose_naive",
    "dense_norm",
    "dora_linear",
    "dora_linear_vjp",
    "factored_norm",
    "from_flax_layout",
    "grads_to_paper_layout",
    "magnitude_init",
    "magnitude_scale",
    "merge",
    "scalar_scaling",
    "scaling_bound",
    "scaling_for",
    "scalora_merge",
    "scalora_scaling",
    "scalora_step_torch",
    "to_flax_layout",
    "to_paper_layout",
    "transfer_adam_moments",
    "transfer_adam_moments_torch",
    "unmerge",
]
