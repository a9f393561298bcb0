"""``dora_torch.Linear``: a DoRA-adapted linear layer with PEFT's parameter names.

Parameters (state-dict keys, one-to-one with PEFT's up to the ``.weight`` / adapter-name
suffixes, which the interop layer maps):

  weight [out, in], bias [out]   frozen     PEFT: base_layer.weight / .bias
  lora_A [r, in]                 trainable  PEFT: lora_A.<name>.weight
  lora_B [out, r]                trainable  PEFT: lora_B.<name>.weight
  lora_magnitude_vector [out]    trainable  PEFT: lora_magnitude_vector.<name>.weight

Adapter dtype follows PEFT's rule: the base layer's dtype, except fp32 on fp16/bf16 bases
(``adapter_dtype`` overrides it). Adapters are cast to the activation dtype once per
parameter update (the module's cache keeps the casts with the norm; docs/design.md §8).
Initialisation as PEFT: A kaiming-uniform(a=√5), B = 0, m = ‖W + s·B·A‖_row (= ‖W‖_row), so
a fresh layer reproduces the base layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from shared_spec import scaling_for as spec_scaling_for

from . import cache, checks
from .functional import module_dora_linear
from .merge import merge_weight, unmerge_weight
from .norm import factored_norm
from .stacking import StackedWeights


def scaling_for(r: int, lora_alpha: float, use_rslora: bool = False) -> float:
    """s = alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's convention; the spec's rule)."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r must be a positive int; got {r!r}")
    lora_alpha = checks.check_lora_alpha(lora_alpha)
    if not isinstance(use_rslora, bool):
        raise TypeError(f"use_rslora must be a bool; got {use_rslora!r}")
    return spec_scaling_for(r, lora_alpha, use_rslora)


class Linear(nn.Module):
    """DoRA linear layer. x [..., in_features] → [..., out_features] in x's dtype.

    Keyword options: r, lora_alpha, use_rslora, lora_dropout (PEFT semantics), bias,
    device, dtype (of the base weight/bias), adapter_dtype (default None: PEFT's rule, the
    base dtype except fp32 on fp16/bf16 bases), impl ("auto" | "fused" | "eager"),
    exact_norm_grad, recompute_inner (keep no [tokens, out_features] tensor for the
    magnitude gradient: backward recomputes the product instead, one more GEMM of the base
    product's size; for layers whose output the next op does not keep, see README "Memory (torch)"),
    stack_weights (experimental: W, and A when it has W's dtype, re-homed into one buffer
    F = [W; A] so that eager fused calls form dx as one GEMM where they made two, and the
    forward's x Wᵀ, x Aᵀ too with ``config.STACK_FORWARD``; ``dora_torch.stacking``,
    docs/design.md §4).
    ``last_impl`` records the tier of the last call (eager calls).
    Every argument is validated before anything is built or frozen.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        r: int,
        lora_alpha: float,
        use_rslora: bool = False,
        lora_dropout: float = 0.0,
        bias: bool = True,
        device=None,
        dtype=None,
        adapter_dtype: torch.dtype | None = None,
        impl: str = "auto",
        exact_norm_grad: bool = False,
        recompute_inner: bool = False,
        stack_weights: bool = False,
    ):
        super().__init__()
        _validate(r, lora_alpha, use_rslora, lora_dropout, adapter_dtype, impl, recompute_inner,
                  stack_weights)  # fmt: skip
        base = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(
            base.weight,
            base.bias,
            r=r,
            lora_alpha=lora_alpha,
            use_rslora=use_rslora,
            lora_dropout=lora_dropout,
            adapter_dtype=adapter_dtype,
            impl=impl,
            exact_norm_grad=exact_norm_grad,
            recompute_inner=recompute_inner,
            stack_weights=stack_weights,
        )

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        r: int,
        lora_alpha: float,
        use_rslora: bool = False,
        lora_dropout: float = 0.0,
        adapter_dtype: torch.dtype | None = None,
        impl: str = "auto",
        exact_norm_grad: bool = False,
        recompute_inner: bool = False,
        stack_weights: bool = False,
    ) -> Linear:
        """Wrap an existing ``nn.Linear``: its weight and bias Parameters are shared (not
        copied) and frozen (with ``stack_weights`` the weight Parameter's storage moves into
        the stacked buffer, its values and identity kept). Atomic: a bad argument raises
        before ``linear`` is touched."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear; got {type(linear).__name__}")
        if linear.weight.dtype not in checks.FLOAT_DTYPES:
            raise TypeError(f"linear.weight must be floating point; got {linear.weight.dtype}")
        _validate(r, lora_alpha, use_rslora, lora_dropout, adapter_dtype, impl, recompute_inner,
                  stack_weights)  # fmt: skip
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(
            linear.weight,
            linear.bias,
            r=r,
            lora_alpha=lora_alpha,
            use_rslora=use_rslora,
            lora_dropout=lora_dropout,
            adapter_dtype=adapter_dtype,
            impl=impl,
            exact_norm_grad=exact_norm_grad,
            recompute_inner=recompute_inner,
            stack_weights=stack_weights,
        )
        return self

    def _setup(
        self,
        weight,
        bias,
        *,
        r,
        lora_alpha,
        use_rslora,
        lora_dropout,
        adapter_dtype,
        impl,
        exact_norm_grad,
        recompute_inner,
        stack_weights,
    ):
        self.scaling = scaling_for(r, lora_alpha, use_rslora)
        self.r, self.lora_alpha, self.use_rslora = r, lora_alpha, use_rslora
        self.lora_dropout = checks.check_dropout(lora_dropout)
        self.impl = checks.check_impl(impl)
        self.exact_norm_grad = bool(exact_norm_grad)
        self.recompute_inner = recompute_inner
        self.out_features, self.in_features = weight.shape
        kw = {
            "device": weight.device,
            "dtype": checks.adapter_dtype_for(weight.dtype, adapter_dtype),
        }
        lora_A = nn.Parameter(torch.empty(r, self.in_features, **kw))
        lora_B = nn.Parameter(torch.zeros(self.out_features, r, **kw))
        nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5))
        with torch.no_grad():
            m = factored_norm(weight, lora_A, lora_B, self.scaling, impl="eager")
        # Nothing above touched the base layer (the stack re-homes W's storage last, with its
        # values); from here on nothing can fail.
        self._dora_stack = StackedWeights(weight, lora_A) if stack_weights else None
        weight.requires_grad_(False)
        self.weight = weight
        if bias is not None:
            bias.requires_grad_(False)
        self.bias = bias
        self.lora_A, self.lora_B = lora_A, lora_B
        self.lora_magnitude_vector = nn.Parameter(m.to(kw["dtype"]))
        self.merged = False
        self._merge_norm: torch.Tensor | None = None
        self.last_impl: str | None = None
        cache.attach(self, Linear._dora_tensors_of, Linear._weight_of)
        if stack_weights:
            self.register_load_state_dict_post_hook(Linear._restack)

    @staticmethod
    def _weight_of(layer: Linear) -> torch.Tensor:
        return layer.weight

    @staticmethod
    def _dora_tensors_of(layer: Linear):
        """(W, A, B, s, impl) for the norm cache; None while merged (no norm is used)."""
        if layer.merged:
            return None
        return layer.weight, layer.lora_A, layer.lora_B, layer.scaling, layer.impl

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
            f"lora_alpha={self.lora_alpha}, use_rslora={self.use_rslora}, "
            f"lora_dropout={self.lora_dropout}, bias={self.bias is not None}, impl={self.impl!r}"
            + (", recompute_inner=True" if self.recompute_inner else "")
            + (", stack_weights=True" if self._dora_stack is not None else "")
        )

    def __setstate__(self, state: dict) -> None:
        """Unpickled (``torch.load`` of a whole model, ``copy.deepcopy``): a stacked layer
        re-stacks (its cache came back empty and follows optimizer steps again by itself)."""
        super().__setstate__(state)
        self._restack()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._restack()
        return self

    def _restack(self, *_hook_args) -> None:
        """Move W (and A) into a new stacked buffer after something gave them new storage
        (``to()``, ``load_state_dict(assign=True)``; the old buffer went with the old
        storage, which the stack does not keep)."""
        stack = self.__dict__.get("_dora_stack")
        if stack is not None and not stack.holds(self.weight, self.lora_A):
            self._dora_stack = StackedWeights(self.weight, self.lora_A)

    def norm(self, *, impl: str = "auto") -> torch.Tensor:
        """The current detached norm ‖W + s·B·A‖_row [out] in the compute dtype (cached)."""
        return self._dora_norm_cache.norm(
            self.weight, self.lora_A, self.lora_B, self.scaling, impl=impl
        )

    def train(self, mode: bool = True) -> Linear:
        super().train(mode)
        cache.track_mode(self)  # eval: the compiled graphs' norm buffer is refreshed now
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            checks.check_input(x, self.weight)
            self.last_impl = "merged"
            return F.linear(x, self.weight, self.bias)
        y, tier = module_dora_linear(
            self._dora_norm_cache,
            self,
            x,
            self.weight,
            self.lora_A,
            self.lora_B,
            self.lora_magnitude_vector,
            self.scaling,
            self.bias,
            dropout_p=self.lora_dropout,
            training=self.training,
            impl=self.impl,
            exact_norm_grad=self.exact_norm_grad,
            recompute_inner=self.recompute_inner,
            stack=self._dora_stack,
        )
        if not torch.compiler.is_compiling():
            self.__dict__["last_impl"] = tier  # a plain attribute: skip Module.__setattr__
        return y

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapter into ``weight`` in place: W ← g ⊙ (W + s·B·A)."""
        if self.merged:
            return
        n = factored_norm(self.weight, self.lora_A, self.lora_B, self.scaling, impl="eager")
        self.weight.copy_(
            merge_weight(
                self.weight,
                self.lora_A,
                self.lora_B,
                self.lora_magnitude_vector,
                self.scaling,
                n,
            )
        )
        self._merge_norm = n
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo ``merge`` with the norm cached at merge time."""
        if not self.merged:
            return
        self.weight.copy_(
            unmerge_weight(
                self.weight,
                self.lora_A,
                self.lora_B,
                self.lora_magnitude_vector,
                self.scaling,
                self._merge_norm,
            )
        )
        self._merge_norm = None
        self.merged = False
        cache.track_mode(self)


def _validate(
    r, lora_alpha, use_rslora, lora_dropout, adapter_dtype, impl, recompute_inner, stack_weights
):
    """Every constructor argument, before anything is built or frozen (named errors)."""
    scaling_for(r, lora_alpha, use_rslora)
    checks.check_bool(recompute_inner, "recompute_inner")
    checks.check_bool(stack_weights, "stack_weights")
    checks.check_dropout(lora_dropout)
    checks.check_adapter_dtype(adapter_dtype)
    checks.check_impl(impl)
