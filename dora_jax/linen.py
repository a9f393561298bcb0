"""``dora_jax.linen.DoraDense``: the Flax linen twin of the nnx layer, same functional core.

Parameters live in the "params" collection with the nnx names and Flax layout (kernel, bias,
lora_a, lora_b, magnitude); freeze the base with an optax mask (e.g. ``optax.multi_transform``
on the names). Both layers call ``dora_jax.functional.dora_dense``, so on the same parameters
they give the same numbers.

The adapter arguments use PEFT's names (``r``, ``lora_alpha``, ``use_rslora``, ``lora_dropout``)
and, after ``features``, are keyword-only; ``rank``/``alpha`` are deprecated aliases for one
release. ``merge_params`` / ``unmerge_params`` fold the adapter into (and out of) the params of
an ``nn.Dense``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from shared_spec.initialization import scaling_for

from .checks import check_dropout, check_rank, renamed_argument
from .config import check_impl, default_adapter_dtype
from .functional import dora_dense
from .initializers import lora_a_init, lora_b_init
from .merge import merge_weight, unmerge_weight
from .norm import factored_norm


class DoraDense(nn.Module):
    """DoRA dense layer (linen). x [..., d_in] → [..., features]; see ``dora_jax.DoraDense``.

    Attributes (all but ``features`` keyword-only): ``r``, ``lora_alpha``, ``use_rslora``,
    ``lora_dropout`` as PEFT; ``use_bias``, ``dtype``, ``param_dtype``, ``kernel_init``,
    ``bias_init`` as ``nn.Dense``; ``adapter_dtype`` (default None: PEFT's rule, the kernel's
    ``param_dtype``, or float32 over float16/bfloat16); ``impl`` and ``exact_norm_grad`` as
    ``dora_dense``. ``rank`` and ``alpha`` are deprecated aliases of ``r`` and
    ``lora_alpha`` (a DeprecationWarning; they read as None once resolved).

    Adapter dropout (``lora_dropout > 0``) follows ``nn.Dropout``: active when ``deterministic``
    (given as the attribute or as the call argument, exactly one of them: ``nn.merge_param``) is
    False, with keys from the 'dropout' rng collection (``apply(..., rngs={"dropout": key})``).
    """

    features: int
    _: dataclasses.KW_ONLY
    r: int | None = None
    lora_alpha: float | None = None
    use_rslora: bool = False
    lora_dropout: float = 0.0
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    adapter_dtype: Any = None
    kernel_init: Any = nn.linear.default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    impl: str = "auto"
    exact_norm_grad: bool = False
    deterministic: bool | None = None
    rank: int | None = None  # deprecated alias of r
    alpha: float | None = None  # deprecated alias of lora_alpha

    def __post_init__(self):
        check_impl(self.impl)
        # Resolve the deprecated aliases once; clones (Flax re-creates modules) then carry only
        # the new names, so they neither warn again nor see both names.
        r = renamed_argument("linen.DoraDense", "r", self.r, "rank", self.rank)
        alpha = renamed_argument(
            "linen.DoraDense", "lora_alpha", self.lora_alpha, "alpha", self.alpha
        )
        object.__setattr__(self, "r", check_rank(r))
        object.__setattr__(self, "lora_alpha", alpha)
        object.__setattr__(self, "rank", None)
        object.__setattr__(self, "alpha", None)
        super().__post_init__()

    @property
    def scaling(self) -> float:
        return scaling_for(self.r, self.lora_alpha, self.use_rslora)

    @property
    def adapter_param_dtype(self):
        """The dtype lora_a, lora_b and magnitude are created in (PEFT's rule by default)."""
        if self.adapter_dtype is not None:
            return self.adapter_dtype
        return default_adapter_dtype(self.param_dtype)

    @nn.compact
    def __call__(self, x, deterministic: bool | None = None):
        d_in = jnp.shape(x)[-1]
        kernel = self.param("kernel", self.kernel_init, (d_in, self.features), self.param_dtype)
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        adt = self.adapter_param_dtype
        lora_a = self.param("lora_a", lora_a_init, (d_in, self.r), adt)
        lora_b = self.param("lora_b", lora_b_init, (self.r, self.features), adt)
        magnitude = self.param(
            "magnitude",
            lambda _key: factored_norm(kernel, lora_a, lora_b, self.scaling).astype(adt),
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
            dropout_rate=rate,
            dropout_rng=key,
            deterministic=key is None,
        )


def merge_params(params, *, scaling: float) -> dict:
    """The params of an ``nn.Dense`` equivalent to a linen DoraDense with these ``params``
    (``dora_jax.merge_weight`` on the kernel; the bias is reused)."""
    out = {
        "kernel": merge_weight(
            params["kernel"], params["lora_a"], params["lora_b"], params["magnitude"], scaling
        )
    }
    if "bias" in params:
        out["bias"] = params["bias"]
    return out


def unmerge_params(dense_params, adapter_params, *, scaling: float, norm) -> dict:
    """Inverse of ``merge_params``: the DoraDense params from the merged ``nn.Dense`` params and
    the adapter (``lora_a``, ``lora_b``, ``magnitude``), given the column ``norm`` of the
    unmerged kernel (``factored_norm`` of it, saved before merging)."""
    out = {
        "kernel": unmerge_weight(
            dense_params["kernel"],
            adapter_params["lora_a"],
            adapter_params["lora_b"],
            adapter_params["magnitude"],
            scaling,
            norm,
        ),
        **{k: adapter_params[k] for k in ("lora_a", "lora_b", "magnitude")},
    }
    if "bias" in dense_params:
        out["bias"] = dense_params["bias"]
    return out
