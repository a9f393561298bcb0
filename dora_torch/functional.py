"""``dora_linear``: the functional DoRA layer (any leading dims, three tiers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import checks, ops
from .cache import NormCache
from .config import EPS
from .dispatch import resolve_impl
from .norm import factored_norm


def dora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    magnitude: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
    impl: str = "auto",
    exact_norm_grad: bool = False,
    norm: torch.Tensor | None = None,
    base_sq: torch.Tensor | None = None,
) -> torch.Tensor:
    """DoRA linear: ``y = g ⊙ (x Wᵀ + s·(x Aᵀ) Bᵀ) + bias`` with g = m / max(‖W + s·B·A‖, eps).

    Args:
      x: [..., d_in], same dtype and device as weight (fp16/bf16/fp32/fp64).
      weight: [d_out, d_in], frozen (no gradient is computed for it).
      lora_A: [r, d_in]; lora_B: [d_out, r]; magnitude: [d_out]. Any float dtype (fp32 like
        PEFT's default is fine: the adapter products run in x's dtype with fp32 accumulation,
        gradients come back in each parameter's dtype).
      scaling: s = alpha / r (alpha / sqrt(r) with rsLoRA).
      bias: [d_out] or None; not scaled by g.
      dropout_p, training: adapter dropout with PEFT's semantics (DESIGN §1) when training.
      impl: "auto" | "fused" | "eager" (see ``dora_torch.dispatch``).
      exact_norm_grad: also backpropagate through the norm (DESIGN §2); default detached.
      norm: optional precomputed norm, fp32 [d_out] (modules pass their cached one); ignored
        with exact_norm_grad.
      base_sq: optional cached ‖W_i‖², fp32 [d_out], used when the norm is computed here.

    Returns [..., d_out] in x's dtype.
    """
    return _dora_linear(
        x,
        weight,
        lora_A,
        lora_B,
        magnitude,
        scaling,
        bias,
        dropout_p=dropout_p,
        training=training,
        impl=impl,
        exact_norm_grad=exact_norm_grad,
        norm=norm,
        base_sq=base_sq,
    )[0]


def module_dora_linear(
    cache: NormCache,
    x,
    weight,
    lora_A,
    lora_B,
    magnitude,
    scaling: float,
    bias=None,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
    impl: str = "auto",
    exact_norm_grad: bool = False,
) -> tuple[torch.Tensor, str]:
    """``dora_linear`` for a module that owns ``cache`` (``dora_torch.Linear`` and PEFT layers
    under ``accelerate_peft``): the norm, ‖W‖² and the adapter casts come from the cache,
    so they are computed once per parameter update. Returns (y, tier)."""
    norm = base_sq = adapters = None
    # The cache reads version counters: outside compiled graphs only (a compiled module
    # recomputes the norm inside its graph). Bad inputs fall through to dora_linear's errors.
    if not torch.compiler.is_compiling() and isinstance(x, torch.Tensor):
        if exact_norm_grad:
            base_sq = cache.base_sq(weight)  # W is frozen: read it once
        elif x.is_floating_point():
            impl = resolve_impl(impl, x, weight.shape[0])  # resolved once per call
            if torch.is_autocast_enabled(x.device.type):  # the dtype is chosen inside
                norm = cache.norm(weight, lora_A, lora_B, scaling, impl=impl)
            else:
                norm, a, b = cache.state(weight, lora_A, lora_B, scaling, impl=impl, dtype=x.dtype)
                adapters = (a, b)
    return _dora_linear(
        x,
        weight,
        lora_A,
        lora_B,
        magnitude,
        scaling,
        bias,
        dropout_p=dropout_p,
        training=training,
        impl=impl,
        exact_norm_grad=exact_norm_grad,
        norm=norm,
        base_sq=base_sq,
        adapters=adapters,
    )


def _dora_linear(
    x,
    weight,
    lora_A,
    lora_B,
    magnitude,
    scaling,
    bias=None,
    *,
    dropout_p=0.0,
    training=False,
    impl="auto",
    exact_norm_grad=False,
    norm=None,
    base_sq=None,
    adapters=None,
) -> tuple[torch.Tensor, str]:
    """``dora_linear`` that also returns the tier that ran. ``adapters``: optional (a, b),
    lora_A and lora_B already cast to x's dtype and detached (a module cache's casts)."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        # Under autocast, run the whole layer in the autocast dtype with autocast off (as
        # nn.Linear's matmuls would), so every product inside sees one activation dtype.
        dt = torch.get_autocast_dtype(x.device.type)
        with torch.autocast(x.device.type, enabled=False):
            return _dora_linear(
                x.to(dt),
                weight.to(dt),
                lora_A,
                lora_B,
                magnitude,
                scaling,
                None if bias is None else bias.to(dt),
                dropout_p=dropout_p,
                training=training,
                impl=impl,
                exact_norm_grad=exact_norm_grad,
                norm=norm,
                base_sq=base_sq,
            )
    d_out, d_in, _ = checks.check_adapter(weight, lora_A, lora_B, magnitude, bias)
    checks.check_input(x, weight)
    s = checks.check_scaling(scaling)
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")
    tier = resolve_impl(impl, x, d_out)

    if exact_norm_grad:
        n = factored_norm(weight, lora_A, lora_B, s, base_sq=base_sq, impl=tier).clamp_min(EPS)
    elif norm is None:
        with torch.no_grad():
            n = factored_norm(weight, lora_A, lora_B, s, base_sq=base_sq, impl=tier)
    else:
        if tuple(norm.shape) != (d_out,) or norm.dtype != torch.float32:
            raise ValueError(
                f"norm must be fp32 of shape ({d_out},); got {norm.dtype} {tuple(norm.shape)}"
            )
        n = norm.detach()

    lead = x.shape[:-1]
    x2 = x.reshape(-1, d_in)
    x_d = F.dropout(x2, float(dropout_p), training=True) if training and dropout_p > 0 else None
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, lora_A, lora_B, magnitude, bias, n)
    )
    if not needs_grad:
        save = ops.SAVE_NONE
    elif tier == "fused" and bias is None and x_d is None and x.dtype != torch.float16:
        save = ops.SAVE_RECOVER  # see ops: when recovering inner from y is sound
    else:
        save = ops.SAVE_INNER
    w = weight.detach()
    if torch.compiler.is_compiling():
        args = (x2, x_d, w, lora_A, lora_B, magnitude, n, bias, s, tier, save)
        y = torch.ops.dora_torch.linear_forward(*args)[0]
    else:
        a, b = adapters or (lora_A.detach().to(x.dtype), lora_B.detach().to(x.dtype))
        if save == ops.SAVE_NONE:  # no autograd bookkeeping at all
            y = ops.forward_core(x2, x_d, w, a, b, magnitude, n, bias, s, tier, save)[0]
        else:
            args = (x2, x_d, w, lora_A, lora_B, magnitude, n, bias, s, tier, save, a, b)
            y = ops.LinearFunction.apply(*args)
    return y.reshape(*lead, d_out), tier
