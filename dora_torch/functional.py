"""``dora_linear``: the functional DoRA layer (any leading dims, three tiers), and the module
entry point ``module_dora_linear`` that reads the norm from a module's cache or buffer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import checks, config, ops
from .cache import (
    DORA_NORM_BUFFER,
    NormCache,
    compiled_base_sq,
    detached_cast,
    keeps_norm_buffer,
    write_norm_buffer,
)
from .config import EPS
from .dispatch import resolve_impl
from .matmul import compute_dtype
from .norm import factored_norm
from .stacking import StackedWeights


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
    recompute_inner: bool = False,
) -> torch.Tensor:
    """DoRA linear: ``y = g ⊙ (x Wᵀ + s·(x Aᵀ) Bᵀ) + bias`` with g = m / max(‖W + s·B·A‖, eps).

    Args:
      x: [..., d_in], same dtype and device as weight (fp16/bf16/fp32/fp64).
      weight: [d_out, d_in], frozen (no gradient is computed for it).
      lora_A: [r, d_in]; lora_B: [d_out, r]; magnitude: [d_out]. Any float dtype (fp32 like
        PEFT's default is fine: the adapter products run in x's dtype with fp32 accumulation,
        gradients come back in each parameter's dtype).
      scaling: s = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).
      bias: [d_out] or None; not scaled by g.
      dropout_p, training: adapter dropout with PEFT's semantics (docs/design.md §1) when
        training.
      impl: "auto" | "fused" | "eager" (see ``dora_torch.dispatch``).
      exact_norm_grad: also backpropagate through the norm (docs/design.md §2); default
        detached.
      norm: optional precomputed detached norm [d_out] in the compute dtype (fp32; float64
        for float64 inputs); ignored with exact_norm_grad.
      base_sq: optional cached ‖W_i‖² [d_out] in the compute dtype, used when the norm is
        computed here.
      recompute_inner: keep nothing [tokens, d_out] for the magnitude gradient; backward
        recomputes x Wᵀ + s·(x Aᵀ) Bᵀ instead (one GEMM of the base product's size), so the
        layer keeps what a LoRA layer keeps. Worth it where the next op does not keep this
        layer's output (docs/design.md §4). Results are the default path's (dm within
        its rounding).

    Returns [..., d_out] in x's dtype. Norm, composition and reductions run in
    promote(fp32, x's dtype): float64 inputs give float64-accurate results.
    """
    checks.check_adapter(weight, lora_A, lora_B, magnitude, bias)
    checks.check_input(x, weight)
    s = checks.check_scaling(scaling)
    p = checks.check_dropout(dropout_p, "dropout_p")
    recompute = checks.check_bool(recompute_inner, "recompute_inner")
    return _dora_linear(
        x, weight, lora_A, lora_B, magnitude, s, bias, dropout_p=p, training=training,
        impl=impl, exact_norm_grad=exact_norm_grad, norm=norm, base_sq=base_sq,
        recompute_inner=recompute,
    )[0]  # fmt: skip


def module_dora_linear(
    cache: NormCache,
    module: torch.nn.Module,
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
    recompute_inner: bool = False,
    stack: StackedWeights | None = None,
) -> tuple[torch.Tensor, str]:
    """``dora_linear`` for a module that owns ``cache`` (``dora_torch.Linear`` and PEFT layers
    under ``accelerate_peft``), with arguments the module validated when it was built. Eager
    calls take the norm, ‖W‖² and the adapter casts from the cache (computed once per
    parameter update). Compiled graphs cannot run the cache's checks: in eval mode they read
    the module's norm buffer (refreshed eagerly, ``dora_torch.cache``); in training mode they
    compute the norm in the graph, from the ‖W‖² buffer when ``config.COMPILED_BASE_SQ_BUFFER``
    is on, or read the norm buffer too where the module was attached with
    ``config.COMPILED_TRAIN_NORM = "buffer"``. ``stack``: the module's stacked weights
    (``dora_torch.stacking``), used by eager fused calls without dropout or recomputation
    while they still hold W. Returns (y, tier)."""
    checks.check_input(x, weight)
    compiling = torch.compiler.is_compiling()
    if exact_norm_grad:
        base_sq = None if compiling else cache.base_sq(weight)
        return _dora_linear(
            x, weight, lora_A, lora_B, magnitude, scaling, bias, dropout_p=dropout_p,
            training=training, impl=impl, exact_norm_grad=True, base_sq=base_sq,
            recompute_inner=recompute_inner,
        )  # fmt: skip
    if compiling:
        norm = getattr(module, DORA_NORM_BUFFER, None) if keeps_norm_buffer(module) else None
        if norm is not None and (
            norm.shape != magnitude.shape or norm.dtype != compute_dtype(weight.dtype)
        ):
            norm = None  # never refreshed, or cast by module.to(dtype): compute it here
        base_sq = compiled_base_sq(module, weight) if norm is None else None
        return _dora_linear(
            x, weight, lora_A, lora_B, magnitude, scaling, bias, dropout_p=dropout_p,
            training=training, impl=impl, norm=norm, base_sq=base_sq,
            recompute_inner=recompute_inner,
        )  # fmt: skip
    tier = resolve_impl(impl, x, weight.shape[0])
    if torch.is_autocast_enabled(x.device.type):  # the activation dtype is chosen inside
        norm = cache.norm(weight, lora_A, lora_B, scaling, impl=tier)
        return _dora_linear(
            x, weight, lora_A, lora_B, magnitude, scaling, bias, dropout_p=dropout_p,
            training=training, impl=impl, norm=norm, recompute_inner=recompute_inner,
        )  # fmt: skip
    computed = cache.norm_computations
    entry = cache.state(weight, lora_A, lora_B, scaling, impl=tier, dtype=x.dtype)
    norm, a, b = entry
    if computed != cache.norm_computations and keeps_norm_buffer(module):
        write_norm_buffer(module, norm)  # eager calls keep the compiled graphs' copy fresh
    stacked = None
    if (
        stack is not None
        and tier == "fused"
        and (config.STACK_FORWARD or torch.is_grad_enabled())  # else nothing would read F
        and not recompute_inner
        and not (training and dropout_p > 0)
        and stack.holds(weight, lora_A)
    ):
        a, stacked = stack.adapter_rows(entry, weight), stack.buffer(weight)
    # The cache's entry is the norm of this tier and dtype: straight to the products.
    y = _run(x, weight, lora_A, lora_B, magnitude, norm, scaling, bias, tier=tier,
             dropout_p=dropout_p, training=training, adapters=(a, b),
             recompute_inner=recompute_inner, stacked=stacked)  # fmt: skip
    return y, tier


def _dora_linear(
    x,
    weight,
    lora_A,
    lora_B,
    magnitude,
    scaling: float,
    bias=None,
    *,
    dropout_p=0.0,
    training=False,
    impl="auto",
    exact_norm_grad=False,
    norm=None,
    base_sq=None,
    recompute_inner=False,
) -> tuple[torch.Tensor, str]:
    """The layer on validated arguments; also returns the tier that ran."""
    if torch.is_autocast_enabled(x.device.type):
        # Under autocast, run the whole layer in the autocast dtype with autocast off (as
        # nn.Linear's matmuls would), so every product inside sees one activation dtype.
        dt = torch.get_autocast_dtype(x.device.type)
        with torch.autocast(x.device.type, enabled=False):
            return _dora_linear(
                x.to(dt), weight.to(dt), lora_A, lora_B, magnitude, scaling,
                None if bias is None else bias.to(dt), dropout_p=dropout_p, training=training,
                impl=impl, exact_norm_grad=exact_norm_grad, norm=norm, base_sq=base_sq,
                recompute_inner=recompute_inner,
            )  # fmt: skip
    d_out = weight.shape[0]
    tier = resolve_impl(impl, x, d_out)
    acc = compute_dtype(weight.dtype)
    if exact_norm_grad:
        n = factored_norm(weight, lora_A, lora_B, scaling, base_sq=base_sq, impl=tier)
        n = n.clamp_min(EPS)
    elif norm is None:
        with torch.no_grad():
            n = factored_norm(weight, lora_A, lora_B, scaling, base_sq=base_sq, impl=tier)
    else:
        if norm.shape != magnitude.shape or norm.dtype != acc:
            want = "fp32" if acc == torch.float32 else str(acc).removeprefix("torch.")
            raise ValueError(
                f"norm must be {want} of shape ({d_out},) (the compute dtype of {x.dtype} "
                f"inputs); got {norm.dtype} {tuple(norm.shape)}"
            )
        n = norm.detach()
    y = _run(x, weight, lora_A, lora_B, magnitude, n, scaling, bias, tier=tier,
             dropout_p=dropout_p, training=training, recompute_inner=recompute_inner)  # fmt: skip
    return y, tier


COMPILED_TORCH_COMPOSES = ("auto", "inference", "forward", "always", "never")


def compiled_tier(needs_grad: bool, rank: int) -> tuple[str, bool]:
    """(tier, torch_forward) of a compiled call of the fused tier, of adapter rank ``rank``,
    that needs a gradient or not (``config.COMPILED_TORCH_COMPOSE``): "eager" runs forward
    and backward as torch ops; "fused" with torch_forward its forward only, before the fused
    backward."""
    when = config.COMPILED_TORCH_COMPOSE
    if when not in COMPILED_TORCH_COMPOSES:
        raise ValueError(
            f"dora_torch.config.COMPILED_TORCH_COMPOSE must be one of {COMPILED_TORCH_COMPOSES}; "
            f"got {when!r}"
        )
    if when == "always" or (when != "never" and not needs_grad):
        return "eager", False
    if when == "auto":
        min_rank = config.COMPILED_TORCH_FORWARD_MIN_RANK
        if type(min_rank) is not int or min_rank < 1:
            raise ValueError(
                "dora_torch.config.COMPILED_TORCH_FORWARD_MIN_RANK must be an int ≥ 1; "
                f"got {min_rank!r}"
            )
        return "fused", rank >= min_rank
    return "fused", when == "forward"


def _run(
    x, weight, lora_A, lora_B, magnitude, n, scaling, bias, *, tier, dropout_p, training,
    adapters=None, recompute_inner=False, stacked=None,
):  # fmt: skip
    """The products and the composition on validated arguments: ``tier`` resolved ("fused" |
    "eager"), n the norm [d_out] in the compute dtype (detached unless exact_norm_grad made
    it), ``adapters`` optional (a, b): lora_A and lora_B already cast to x's dtype and
    detached (a module cache's); ``recompute_inner``: save nothing [T, d_out] for backward
    (``ops.SAVE_RECOMPUTE``); ``stacked``: F = [W; a] with a = ``adapters[0]``'s values
    (``ops``). Returns y."""
    d_out, d_in = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d_in)
    x_d = F.dropout(x2, float(dropout_p), training=True) if training and dropout_p > 0 else None
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad
        or lora_A.requires_grad
        or lora_B.requires_grad
        or magnitude.requires_grad
        or n.requires_grad
        or (bias is not None and bias.requires_grad)
    )
    torch_forward = False
    if tier == "fused" and torch.compiler.is_compiling():  # torch ops, for Inductor to fuse
        tier, torch_forward = compiled_tier(needs_grad, lora_A.shape[0])
    if not needs_grad:
        save = ops.SAVE_NONE
    elif recompute_inner:
        save = ops.SAVE_RECOMPUTE
    elif tier == "fused" and bias is None and x_d is None and x.dtype != torch.float16:
        save = ops.SAVE_RECOVER  # see ops: when recovering inner from y is sound
    else:
        save = ops.SAVE_INNER
    opts = ops.LinearOptions.of(scaling, tier, save, torch_forward)
    w = weight.detach() if weight.requires_grad else weight  # frozen: no gradient either way
    a, b = adapters or (detached_cast(lora_A, x.dtype), detached_cast(lora_B, x.dtype))
    if save == ops.SAVE_NONE:  # no autograd bookkeeping at all
        y = ops.forward_core(x2, x_d, w, a, b, magnitude, n, bias, opts, stacked)[0]
    else:
        y = ops.apply_linear(x2, x_d, w, lora_A, lora_B, magnitude, n, bias, a, b, stacked, opts)
    if x.dim() != 2:
        if save == ops.SAVE_RECOVER:
            # backward reads y: a real view shares its version counter, so an in-place edit of
            # the output is refused by autograd instead of silently corrupting the gradients.
            y = y.view(*lead, d_out)
        else:  # not a view, like nn.Linear's output (FSDP2 hooks module outputs)
            y = torch.ops.aten._unsafe_view(y, (*lead, d_out))
    return y
