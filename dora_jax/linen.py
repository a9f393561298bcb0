"""``dora_jax.linen.DoraDense``: the Flax linen twin of the nnx layer, same functional core.

Parameters live in the "params" collection with the nnx names and Flax layout (kernel, bias,
lora_a, lora_b, magnitude); freeze the base with an optax mask (e.g. ``optax.multi_transform``
on the names). Both layers call ``dora_jax.functional.dora_dense``, so on the same parameters
they give the same numbers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from shared_spec.initialization import scaling_for

from .checks import check_dropout
from .config import DEFAULT_BLOCKS, BlockConfig
from .functional import dora_dense
from .initializers import lora_a_init, lora_b_init
from .merge import merged_kernel
from .norm import factored_norm


class DoraDense(nn.Module):
    """DoRA dense layer (linen). x [..., d_in] → [..., features]; see ``dora_jax.DoraDense``.

    Adapter dropout (``lora_dropout > 0``) follows ``nn.Dropout``: active when ``deterministic``
    (given as the attribute or as the call argument, exactly one of them: ``nn.merge_param``) is
    False, with keys from the 'dropout' rng collection (``apply(..., rngs={"dropout": key})``).
    """

    features: int
    rank: int
    alpha: float
    use_rslora: bool = False
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    adapter_dtype: Any = jnp.float32
    kernel_init: Any = nn.linear.default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    impl: str = "auto"
    exact_norm_grad: bool = False
    config: BlockConfig = DEFAULT_BLOCKS
    lora_dropout: float = 0.0
    deterministic: bool | None = None

    @property
    def scaling(self) -> float:
        return scaling_for(self.rank, self.alpha, self.use_rslora)

    @nn.compact
    def __call__(self, x, deterministic: bool | None = None):
        d_in = jnp.shape(x)[-1]
        kernel = self.param("kernel", self.kernel_init, (d_in, self.features), self.param_dtype)
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        lora_a = self.param("lora_a", lora_a_init, (d_in, self.rank), self.adapter_dtype)
        lora_b = self.param("lora_b", lora_b_init, (self.rank, self.features), self.adapter_dtype)
        magnitude = self.param(
            "magnitude",
            lambda _key: factored_norm(kernel, lora_a, lora_b, self.scaling).astype(
                self.adapter_dtype
            ),
        )
        x, kernel_c = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        rate = check_dropout(self.lora_dropout, name="lora_dropout")
        key = None
        if rate > 0.0 and not nn.merge_param("deterministic", self.deterministic, deterministic):
            key = self.make_rng("dropout")
        return dora_dense(
            x,
            kernel_c,
            lora_a,
            lora_b,
            magnitude,
            self.scaling,
            bias,
            impl=self.impl,
            exact_norm_grad=self.exact_norm_grad,
            config=self.config,
            dropout_rate=rate,
            dropout_rng=key,
            deterministic=key is None,
        )


def merge_params(params, *, scaling: float) -> dict:
    """The params of an ``nn.Dense`` equivalent to a linen DoraDense with these ``params``."""
    out = {
        "kernel": merged_kernel(
            params["kernel"], params["lora_a"], params["lora_b"], params["magnitude"], scaling
        )
    }
    if "bias" in params:
        out["bias"] = params["bias"]
    return out
