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

__all__ = [
    "EPS",
    "DoraGrads",
    "base_sq_norm",
    "compose",
    "compose_naive",
    "dense_norm",
    "dora_linear",
    "dora_linear_vjp",
    "factored_norm",
    "from_flax_layout",
    "magnitude_init",
    "magnitude_scale",
    "merge",
    "scaling_for",
    "to_flax_layout",
    "unmerge",
]
