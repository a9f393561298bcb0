"""``DoraDense``: an ``nnx.Module`` DoRA layer that drops in for ``nnx.Linear``.

Parameters (Flax layout, names and shapes of nnx.Linear for the frozen part):

    kernel [d_in, d_out], bias [d_out]            nnx.Param, frozen by convention (train with
                                                  ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``)
    lora_a [d_in, r], lora_b [r, d_out],          DoraParam (a subclass of nnx.LoRAParam)
    magnitude [d_out]

Caches are explicit ``DoraCache`` variables, filled and cleared only by the methods that name
them (no hidden global state): ``cache_base_sq()`` stores ||K_:j||² (valid while the kernel is
unchanged); ``freeze_norm()`` stores the whole column norm for inference with a fixed adapter
(valid until lora_a, lora_b or the kernel change); ``clear_cache()`` drops both.

Adapter dropout (``lora_dropout > 0``, PEFT's semantics) follows ``nnx.Dropout``'s conventions:
active while ``deterministic`` is False (``model.train()`` / ``model.eval()`` or ``nnx.view``
set it, a call argument overrides it), keys from the "dropout" stream of the ``rngs`` given at
construction (forked, as nnx.Dropout does) or from a ``rngs`` call argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx

from shared_spec.initialization import scaling_for

from .checks import check_dropout
from .config import DEFAULT_BLOCKS, BlockConfig
from .functional import dora_dense
from .initializers import lora_a_init, lora_b_init
from .merge import merged_kernel
from .norm import base_sq_norm, factored_norm

_ZEROS = nnx.initializers.zeros_init()


class DoraParam(nnx.LoRAParam):
    """A trainable DoRA adapter parameter (lora_a, lora_b, magnitude)."""


class DoraCache(nnx.Variable):
    """A value derived from the parameters (a norm), stored explicitly; never trained."""


def _adapter_sharding(kernel: nnx.Variable) -> tuple[dict, dict, dict]:
    """Sharding metadata for (lora_a, lora_b, magnitude) that follows the kernel's axes."""
    names = kernel.get_metadata().get("out_sharding")
    if not names or len(names) != 2:
        return {}, {}, {}
    value = kernel.get_value()
    mesh = getattr(getattr(value, "sharding", None), "mesh", None)
    common = {"eager_sharding": mesh is not None and not mesh.empty}
    if common["eager_sharding"]:
        common["mesh"] = mesh
    d_in_axis, d_out_axis = names
    return (
        {"out_sharding": (d_in_axis, None), **common},
        {"out_sharding": (None, d_out_axis), **common},
        {"out_sharding": (d_out_axis,), **common},
    )


class DoraDense(nnx.Module):
    """DoRA on a dense layer: ``y = g ⊙ (x·K + s·(x·a)·b) + bias``, g = m / ||K + s·a·b||_col.

    Args:
      in_features, out_features: d_in, d_out.
      rank, alpha, use_rslora: the adapter rank r and scale s = alpha / r (or / sqrt(r)).
      use_bias, dtype, param_dtype, kernel_init, bias_init, kernel_metadata: as nnx.Linear
        (the frozen kernel and bias are created exactly as nnx.Linear would with these rngs).
      adapter_dtype: dtype of lora_a, lora_b and magnitude (default float32, like PEFT).
      impl, exact_norm_grad: passed to ``dora_jax.functional.dora_dense``.
      lora_dropout: adapter dropout rate in [0, 1) (PEFT's ``lora_dropout``; see
        ``dora_dense``'s ``dropout_rate``: the adapter sees dropout(x), the base x).
      deterministic: disables the dropout (as ``nnx.Dropout``: default False, i.e. active until
        ``model.eval()``; it has no effect when ``lora_dropout`` is 0).
      rngs: random keys (``params`` for lora_a; with ``lora_dropout > 0`` the "dropout" stream,
        or the default one, is forked for the masks).

    Call: ``layer(x, *, deterministic=None, rngs=None)``: x [..., d_in] → [..., d_out] in the
    compute dtype (``dtype``, or x and the kernel promoted, as nnx.Linear does);
    ``deterministic`` and ``rngs`` (an nnx.Rngs, RngStream or key) override the layer's.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        alpha: float,
        use_rslora: bool = False,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        adapter_dtype=jnp.float32,
        kernel_init=nnx.nn.linear.default_kernel_init,
        bias_init=_ZEROS,
        kernel_metadata: Mapping = MappingProxyType({}),
        impl: str = "auto",
        exact_norm_grad: bool = False,
        config: BlockConfig = DEFAULT_BLOCKS,
        lora_dropout: float = 0.0,
        deterministic: bool = False,
        base: nnx.Linear | None = None,
        rngs: nnx.Rngs,
    ):
        if base is None:
            base = nnx.Linear(
                in_features,
                out_features,
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=kernel_init,
                bias_init=bias_init,
                kernel_metadata=kernel_metadata,
                rngs=rngs,
            )
        elif (base.in_features, base.out_features) != (in_features, out_features):
            raise ValueError(
                f"base is a {base.in_features}→{base.out_features} nnx.Linear; "
                f"expected {in_features}→{out_features}"
            )
        if int(rank) != rank or rank < 1:
            raise ValueError(f"rank must be a positive integer; got {rank!r}")
        self.lora_dropout = check_dropout(lora_dropout, name="lora_dropout")
        self.deterministic = bool(deterministic)
        self.in_features = in_features
        self.out_features = out_features
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.use_rslora = bool(use_rslora)
        self.scaling = scaling_for(self.rank, self.alpha, self.use_rslora)
        self.use_bias = base.bias is not None
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.impl = impl
        self.exact_norm_grad = bool(exact_norm_grad)
        self.config = config
        # The very Variables of the base layer: values, dtypes and sharding metadata carry over.
        self.kernel = base.kernel
        self.bias = base.bias

        a_meta, b_meta, m_meta = _adapter_sharding(self.kernel)
        kernel = self.kernel.get_value()
        lora_a = lora_a_init(rngs.params(), (in_features, self.rank), adapter_dtype)
        lora_b = lora_b_init(None, (self.rank, out_features), adapter_dtype)
        # m = n at init, so the fresh adapter reproduces the base layer (g = 1)
        magnitude = factored_norm(kernel, lora_a, lora_b, self.scaling).astype(adapter_dtype)
        self.lora_a = DoraParam(lora_a, **a_meta)
        self.lora_b = DoraParam(lora_b, **b_meta)
        self.magnitude = DoraParam(magnitude, **m_meta)
        # data attributes (graph nodes) that hold a DoraCache or None
        self.base_sq = nnx.data(None)
        self.frozen_norm = nnx.data(None)
        # the dropout masks' key stream, forked as nnx.Dropout does (after lora_a's key)
        self.dropout_rngs = rngs["dropout"].fork() if self.lora_dropout > 0 else nnx.data(None)

    @classmethod
    def from_linear(
        cls,
        linear: nnx.Linear,
        *,
        rank: int,
        alpha: float,
        rngs: nnx.Rngs,
        use_rslora: bool = False,
        adapter_dtype=jnp.float32,
        impl: str = "auto",
        exact_norm_grad: bool = False,
        config: BlockConfig = DEFAULT_BLOCKS,
        lora_dropout: float = 0.0,
        deterministic: bool = False,
    ) -> DoraDense:
        """Wrap an existing ``nnx.Linear``; its kernel and bias Variables are reused, not copied."""
        if not isinstance(linear, nnx.Linear):
            raise ValueError(f"linear must be an nnx.Linear; got {type(linear).__name__}")
        return cls(
            linear.in_features,
            linear.out_features,
            rank=rank,
            alpha=alpha,
            use_rslora=use_rslora,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
            adapter_dtype=adapter_dtype,
            impl=impl,
            exact_norm_grad=exact_norm_grad,
            config=config,
            lora_dropout=lora_dropout,
            deterministic=deterministic,
            base=linear,
            rngs=rngs,
        )

    # -- forward ------------------------------------------------------------------------------

    def _compute_dtype(self, x):
        return nnx.nn.dtypes.canonicalize_dtype(x, self.kernel.get_value(), dtype=self.dtype)

    def set_view(self, deterministic: bool | None = None):
        """Used by ``nnx.view`` (as ``nnx.Dropout.set_view``)."""
        if deterministic is not None:
            self.deterministic = deterministic

    def _dropout_key(self, deterministic, rngs):
        """The key for this call's dropout mask, or None when dropout is off."""
        deterministic = self.deterministic if deterministic is None else deterministic
        if self.lora_dropout == 0.0 or deterministic:
            return None
        rngs = self.dropout_rngs if rngs is None else rngs
        if isinstance(rngs, nnx.Rngs):
            return rngs["dropout"]()
        if isinstance(rngs, nnx.RngStream):
            return rngs()
        if isinstance(rngs, jax.Array):
            return rngs
        raise ValueError(
            f"rngs must be an nnx.Rngs, RngStream or key for lora_dropout; got {type(rngs)}"
        )

    def __call__(self, x, *, deterministic: bool | None = None, rngs=None):
        key = self._dropout_key(deterministic, rngs)
        cd = self._compute_dtype(x)
        kernel = self.kernel.get_value().astype(cd)
        bias = None if self.bias is None else self.bias.get_value()
        return dora_dense(
            jnp.asarray(x, cd),
            kernel,
            self.lora_a.get_value(),
            self.lora_b.get_value(),
            self.magnitude.get_value(),
            self.scaling,
            bias,
            impl=self.impl,
            exact_norm_grad=self.exact_norm_grad,
            norm=None if self.frozen_norm is None else self.frozen_norm.get_value(),
            base_sq=None if self.base_sq is None else self.base_sq.get_value(),
            config=self.config,
            dropout_rate=self.lora_dropout,
            dropout_rng=key,
            deterministic=key is None,
        )

    # -- explicit caches ----------------------------------------------------------------------

    def norm(self, dtype=None):
        """The current column norm f32 [d_out] (kernel in ``dtype``, default the compute dtype)."""
        kernel = self.kernel.get_value()
        cd = (self.dtype or kernel.dtype) if dtype is None else dtype
        return factored_norm(
            kernel.astype(cd), self.lora_a.get_value(), self.lora_b.get_value(), self.scaling
        )

    def cache_base_sq(self) -> None:
        """Store ||K_:j||² (the part of the norm the frozen kernel fixes) for later calls."""
        self.base_sq = DoraCache(base_sq_norm(self.kernel.get_value()))

    def freeze_norm(self, dtype=None) -> None:
        """Compute the norm once and reuse it on every call (inference with a fixed adapter).

        Gradients then treat it as a constant; call ``clear_cache()`` after changing the adapter.
        """
        if self.exact_norm_grad:
            raise ValueError("freeze_norm() conflicts with exact_norm_grad=True")
        self.frozen_norm = DoraCache(self.norm(dtype))

    def clear_cache(self) -> None:
        """Forget the cached base_sq and frozen norm (call after changing kernel or adapter)."""
        self.base_sq = None
        self.frozen_norm = None

    # -- merging ------------------------------------------------------------------------------

    def merge(self) -> nnx.Linear:
        """An ``nnx.Linear`` whose kernel is g ⊙ (K + s·a·b): the layer with the adapter folded in.

        The kernel keeps its Variable metadata (sharding); the bias Variable is shared.
        """
        kernel = self.kernel.get_value()
        merged = merged_kernel(
            kernel,
            self.lora_a.get_value(),
            self.lora_b.get_value(),
            self.magnitude.get_value(),
            self.scaling,
        )
        linear = nnx.eval_shape(
            lambda: nnx.Linear(
                self.in_features,
                self.out_features,
                use_bias=self.use_bias,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                rngs=nnx.Rngs(0),
            )
        )
        linear.kernel = self.kernel.copy(merged)
        linear.bias = self.bias
        return linear
