"""``dora_linear``: the functional DoRA layer (any leading dims, three tiers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import checks, ops
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
) -> tuple[torch.Tensor, str]:
    """``dora_linear`` that also returns the tier that ran."""
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
    args = (x2, x_d, weight.detach(), lora_A, lora_B, magnitude, n, bias, s, tier, save)
    if torch.compiler.is_compiling():
        y, _, _ = torch.ops.dora_torch.linear_forward(*args)
    elif save == ops.SAVE_NONE:
        y, _, _ = ops.forward_impl(*args)  # no autograd bookkeeping at all
    else:
        y, _, _ = ops.LinearFunction.apply(*args)
    return y.reshape(*lead, d_out), tier
