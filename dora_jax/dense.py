"""``DoraDense``: an ``nnx.Module`` DoRA layer that drops in for ``nnx.Linear``.

Parameters (Flax layout, names and shapes of nnx.Linear for the frozen part):

    kernel [d_in, d_out], bias [d_out]            nnx.Param, frozen by convention (train with
                                                  ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``)
    lora_a [d_in, r], lora_b [r, d_out],          DoraParam (a subclass of nnx.LoRAParam)
    magnitude [d_out]

Adapter dtype (PEFT's rule): lora_a, lora_b and magnitude take the base kernel's dtype, except
over a float16/bfloat16 kernel, where they default to float32; ``adapter_dtype`` overrides.
A float64 kernel (with ``jax_enable_x64``) gives float64 adapters, and the layer then computes
the norm, g and the composition in float64 (``dora_dense``).

Merging (as ``dora_torch.Linear``): ``merge()`` folds the adapter into the kernel in place
(K ← g ⊙ (K + s·a·b)); the layer then computes the plain dense product and ``merged`` is True.
``unmerge()`` restores the kernel with the norm saved at merge time. Both are no-ops when
repeated. Do not change the adapter between the two. ``to_linear()`` instead returns a new
``nnx.Linear`` with the merged kernel and leaves this layer untouched.

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

from .checks import check_dropout, check_rank, renamed_argument
from .config import check_impl, default_adapter_dtype
from .functional import dora_dense
from .initializers import lora_a_init, lora_b_init
from .merge import merge_weight, unmerge_weight
from .norm import base_sq_norm, factored_norm

_ZEROS = nnx.initializers.zeros_init()


class DoraParam(nnx.LoRAParam):
    """A trainable DoRA adapter parameter (lora_a, lora_b, magnitude)."""


class DoraCache(nnx.Variable):
    """A value derived from the parameters (a norm), stored explicitly; never trained."""


def _adapter_sharding(kernel: nnx.Variable) -> tuple[dict, dict, dict]:
    """Sharding metadata for (lora_a, lora_b, magnitude) that follows the kernel's axes."""
    meta = kernel.get_metadata()
    names = meta.get("out_sharding")
    if not names or len(names) != 2:
        return {}, {}, {}
    value = kernel.get_value()
    mesh = getattr(getattr(value, "sharding", None), "mesh", None)
    common = {"eager_sharding": mesh is not None and not mesh.empty}
    if common["eager_sharding"]:
        common["mesh"] = mesh
    if meta.get("sharding_rules") is not None:  # logical names: the adapters need the rules too
        common["sharding_rules"] = meta["sharding_rules"]
    d_in_axis, d_out_axis = names
    return (
        {"out_sharding": (d_in_axis, None), **common},
        {"out_sharding": (None, d_out_axis), **common},
        {"out_sharding": (d_out_axis,), **common},
    )


class DoraDense(nnx.Module):
    """DoRA on a dense layer: ``y = g ⊙ (x·K + s·(x·a)·b) + bias``, g = m / ||K + s·a·b||_col.

    Args (everything after ``out_features`` is keyword-only):
      in_features, out_features: d_in, d_out.
      r, lora_alpha, use_rslora: the adapter rank r and scale s = lora_alpha / r (or / sqrt(r)),
        PEFT's names. ``rank`` and ``alpha`` are deprecated aliases of r and lora_alpha (a
        DeprecationWarning; passing both names of one argument is a TypeError).
      lora_dropout: adapter dropout rate in [0, 1) (PEFT's ``lora_dropout``; see
        ``dora_dense``'s ``dropout_rate``: the adapter sees dropout(x), the base x).
      use_bias, dtype, param_dtype, kernel_init, bias_init, kernel_metadata: as nnx.Linear
        (the frozen kernel and bias are created exactly as nnx.Linear would with these rngs).
      adapter_dtype: dtype of lora_a, lora_b and magnitude; default (None) PEFT's rule: the
        kernel's dtype, float32 over a float16/bfloat16 kernel.
      impl, exact_norm_grad: passed to ``dora_jax.functional.dora_dense``.
      shard_norm: compute the norm as a ``shard_map`` over the context mesh
        (``dora_jax.sharding.sharded_norm_parts``: per-shard GEMMs, a psum when d_in is
        sharded, the assembly per shard), the kernel's spec from its metadata. No effect off a
        mesh.
      deterministic: disables the dropout (as ``nnx.Dropout``: default False, i.e. active until
        ``model.eval()``; it has no effect when ``lora_dropout`` is 0).
      base: an existing nnx.Linear whose Variables to reuse (``from_linear``).
      rngs: random keys (``params`` for lora_a; with ``lora_dropout > 0`` the "dropout" stream,
        or the default one, is forked for the masks).

    Call: ``layer(x, *, deterministic=None, rngs=None)``: x [..., d_in] → [..., d_out] in the
    compute dtype (``dtype``, or x and the kernel promoted, as nnx.Linear does);
    ``deterministic`` and ``rngs`` (an nnx.Rngs, RngStream or key) override the layer's.
    The norm and the composition run in promote_types(float32, compute dtype).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        r: int | None = None,
        lora_alpha: float | None = None,
        use_rslora: bool = False,
        lora_dropout: float = 0.0,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        adapter_dtype=None,
        kernel_init=nnx.nn.linear.default_kernel_init,
        bias_init=_ZEROS,
        kernel_metadata: Mapping = MappingProxyType({}),
        impl: str = "auto",
        exact_norm_grad: bool = False,
        deterministic: bool = False,
        shard_norm: bool = False,
        base: nnx.Linear | None = None,
        rngs: nnx.Rngs,
        rank: int | None = None,
        alpha: float | None = None,
    ):
        impl = check_impl(impl)  # before anything is built or a key drawn
        r = check_rank(renamed_argument("DoraDense", "r", r, "rank", rank))
        lora_alpha = renamed_argument("DoraDense", "lora_alpha", lora_alpha, "alpha", alpha)
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
        self.lora_dropout = check_dropout(lora_dropout, name="lora_dropout")
        self.deterministic = bool(deterministic)
        self.in_features = in_features
        self.out_features = out_features
        self.r = r
        self.lora_alpha = float(lora_alpha)
        self.use_rslora = bool(use_rslora)
        self.scaling = scaling_for(self.r, self.lora_alpha, self.use_rslora)
        self.use_bias = base.bias is not None
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.impl = impl
        self.exact_norm_grad = bool(exact_norm_grad)
        self.shard_norm = bool(shard_norm)
        # The very Variables of the base layer: values, dtypes and sharding metadata carry over.
        self.kernel = base.kernel
        self.bias = base.bias

        a_meta, b_meta, m_meta = _adapter_sharding(self.kernel)
        kernel = self.kernel.get_value()
        if adapter_dtype is None:
            adapter_dtype = default_adapter_dtype(kernel.dtype)
        self.adapter_dtype = jnp.dtype(adapter_dtype)
        lora_a = lora_a_init(rngs.params(), (in_features, self.r), self.adapter_dtype)
        lora_b = lora_b_init(None, (self.r, out_features), self.adapter_dtype)
        # m = n at init, so the fresh adapter reproduces the base layer (g = 1)
        magnitude = factored_norm(kernel, lora_a, lora_b, self.scaling).astype(self.adapter_dtype)
        self.lora_a = DoraParam(lora_a, **a_meta)
        self.lora_b = DoraParam(lora_b, **b_meta)
        self.magnitude = DoraParam(magnitude, **m_meta)
        # data attributes (graph nodes) that hold a DoraCache or None
        self.base_sq = nnx.data(None)
        self.frozen_norm = nnx.data(None)
        # merge state: the flag and the norm of the unmerged kernel, which unmerge() needs
        self.merged = False
        self.merge_norm = nnx.data(None)
        # the dropout masks' key stream, forked as nnx.Dropout does (after lora_a's key)
        self.dropout_rngs = rngs["dropout"].fork() if self.lora_dropout > 0 else nnx.data(None)

    @property
    def rank(self) -> int:
        """Deprecated alias of ``r`` (kept for one release)."""
        return self.r

    @property
    def alpha(self) -> float:
        """Deprecated alias of ``lora_alpha`` (kept for one release)."""
        return self.lora_alpha

    @classmethod
    def from_linear(
        cls,
        linear: nnx.Linear,
        *,
        r: int | None = None,
        lora_alpha: float | None = None,
        rngs: nnx.Rngs,
        use_rslora: bool = False,
        lora_dropout: float = 0.0,
        adapter_dtype=None,
        impl: str = "auto",
        exact_norm_grad: bool = False,
        deterministic: bool = False,
        shard_norm: bool = False,
        rank: int | None = None,
        alpha: float | None = None,
    ) -> DoraDense:
        """Wrap an existing ``nnx.Linear``; its kernel and bias Variables are reused, not copied.

        Takes the constructor's adapter arguments (``r``, ``lora_alpha``, ...; ``rank`` and
        ``alpha`` are deprecated aliases). ``adapter_dtype`` defaults to PEFT's rule on the
        linear's kernel dtype: that dtype, or float32 over a float16/bfloat16 kernel.
        """
        if not isinstance(linear, nnx.Linear):
            raise ValueError(f"linear must be an nnx.Linear; got {type(linear).__name__}")
        r = renamed_argument("DoraDense.from_linear", "r", r, "rank", rank)
        lora_alpha = renamed_argument(
            "DoraDense.from_linear", "lora_alpha", lora_alpha, "alpha", alpha
        )
        return cls(
            linear.in_features,
            linear.out_features,
            r=r,
            lora_alpha=lora_alpha,
            use_rslora=use_rslora,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
            adapter_dtype=adapter_dtype,
            impl=impl,
            exact_norm_grad=exact_norm_grad,
            lora_dropout=lora_dropout,
            deterministic=deterministic,
            shard_norm=shard_norm,
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
        cd = self._compute_dtype(x)
        kernel = self.kernel.get_value().astype(cd)
        bias = None if self.bias is None else self.bias.get_value()
        if self.merged:  # the adapter lives in the kernel: the plain dense layer
            y = jnp.dot(jnp.asarray(x, cd), kernel)
            return y if bias is None else y + bias.astype(cd)
        check_impl(self.impl)  # before a dropout key is drawn
        key = self._dropout_key(deterministic, rngs)
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
            dropout_rate=self.lora_dropout,
            dropout_rng=key,
            deterministic=key is None,
            norm_sharding=self._norm_sharding(),
        )

    def _norm_sharding(self):
        """With ``shard_norm``, under a mesh (``jax.set_mesh``) and with a sharded kernel: the
        norm as a shard_map over that mesh, the kernel's spec from its metadata
        (``dora_jax.sharding``); None (the plain factored norm) otherwise."""
        if not self.shard_norm or jax.sharding.get_abstract_mesh().empty:
            return None
        from .sharding import NormSharding, kernel_spec_of

        spec = tuple(kernel_spec_of(self))
        return None if spec == (None, None) else NormSharding(spec)

    # -- explicit caches ----------------------------------------------------------------------

    def _check_unmerged(self, what: str) -> None:
        if self.merged:
            raise ValueError(f"{what} needs the unmerged kernel; call unmerge() first")

    def norm(self, dtype=None):
        """The current column norm [d_out] (kernel in ``dtype``, default the compute dtype),
        in promote_types(float32, that dtype)."""
        self._check_unmerged("norm()")
        kernel = self.kernel.get_value()
        cd = (self.dtype or kernel.dtype) if dtype is None else dtype
        return factored_norm(
            kernel.astype(cd), self.lora_a.get_value(), self.lora_b.get_value(), self.scaling
        )

    def cache_base_sq(self) -> None:
        """Store ||K_:j||² (the part of the norm the frozen kernel fixes) for later calls."""
        self._check_unmerged("cache_base_sq()")
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

    def _set_kernel(self, value) -> None:
        """Write the kernel in place, keeping its dtype and (concrete) sharding."""
        old = self.kernel.get_value()
        value = value.astype(old.dtype)
        sharding = getattr(old, "sharding", None)
        if sharding is not None and not isinstance(value, jax.core.Tracer):
            value = jax.device_put(value, sharding)
        self.kernel.set_value(value)

    def merge(self) -> None:
        """Fold the adapter into the kernel in place: K ← g ⊙ (K + s·a·b) (``dora_torch.Linear``).

        The layer then computes the plain dense product ``x·K + bias`` and ``merged`` is True;
        the norm of the unmerged kernel (in the kernel's dtype) is kept in ``merge_norm`` for
        ``unmerge()``. A no-op if already merged. The kernel Variable is shared with the
        nnx.Linear the layer wraps (``from_linear``), which therefore sees the merged kernel
        too. Caches are cleared. Use ``to_linear()`` for a separate merged nnx.Linear instead.
        """
        if self.merged:
            return
        kernel = self.kernel.get_value()
        lora_a, lora_b = self.lora_a.get_value(), self.lora_b.get_value()
        n = factored_norm(kernel, lora_a, lora_b, self.scaling)
        merged = merge_weight(kernel, lora_a, lora_b, self.magnitude.get_value(), self.scaling, n)
        self._set_kernel(merged)
        self.merge_norm = DoraCache(n)
        self.merged = True
        self.clear_cache()

    def unmerge(self) -> None:
        """Undo ``merge()`` with the norm saved at merge time; a no-op if not merged.

        Raises ValueError for columns with zero magnitude (m = 0), which merging cannot undo.
        """
        if not self.merged:
            return
        self._set_kernel(
            unmerge_weight(
                self.kernel.get_value(),
                self.lora_a.get_value(),
                self.lora_b.get_value(),
                self.magnitude.get_value(),
                self.scaling,
                self.merge_norm.get_value(),
            )
        )
        self.merge_norm = None
        self.merged = False
        self.clear_cache()

    def to_linear(self) -> nnx.Linear:
        """A new ``nnx.Linear`` whose kernel is g ⊙ (K + s·a·b): the layer with the adapter
        folded in, leaving this layer (and its kernel) unchanged. (Before the in-place
        ``merge()`` existed, this was what ``merge()`` returned.)

        The kernel keeps its Variable metadata (sharding); the bias Variable is shared. If the
        layer is merged, the kernel already holds the folded weight and is copied as is.
        """
        kernel = self.kernel.get_value()
        if not self.merged:
            kernel = merge_weight(
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
        linear.kernel = self.kernel.copy(kernel)
        linear.bias = self.bias
        return linear
