"""The DoRA linear as two ``torch.library`` custom ops with a registered autograd formula.

    dora_torch::linear_forward(x, x_d?, W, A, B, m, n, bias?, s, impl, save) -> (y, h, inner)
    dora_torch::linear_backward(dy, x, x_d?, W, A, B, m, n, bias?, h, saved, s, impl, ...)
        -> (dx, dx_d, dA, dB, dm, dn, dbias)

x [T, d_in] and W [d_out, d_in] share the activation dtype; A [r, d_in], B [d_out, r] and m
may be fp32 (PEFT's default): they are cast to the activation dtype (once per parameter
update in modules, whose cache holds the casts) and their gradients come back in their own
dtype (fp32 GEMM outputs on CUDA). n is the fp32 norm.
x_d = dropout(x) or None (PEFT's dropout form, DESIGN §1). ``impl`` is "fused" (Triton
compose / backward kernels, cuBLAS GEMMs) or "eager" (the same algorithm in torch ops).

What is saved for backward (``save``):
  0  nothing (no gradient needed; ``inner`` is never formed);
  1  inner = x_d Wᵀ + s·h Bᵀ rounded to the activation dtype, stored over the base product's
     buffer (it stays alive until backward; without dropout y then needs its own buffer);
     without saving, the fused forward writes y over that buffer, so it allocates nothing
     beyond the cuBLAS products;
  2  nothing new: inner is recovered in backward as y / g from the output y, which the next
     op usually keeps alive anyway (a following linear or activation saves its input; a
     residual add does not). Used by the fused tier only when it is numerically sound:
     bf16/fp32 activations (fp16's narrow exponent range makes small g·inner subnormal),
     no bias (y − b would cancel when |b| ≫ |g·inner|) and no dropout (y is not g·inner
     there). Columns with g = 0 (m_i = 0) lost inner; the backward kernel recomputes it
     from x, W, h, B there, without a host sync. Otherwise the relative error of y/g is
     that of a rounded saved inner. Consequence: modifying y in place before backward
     raises autograd's "modified by an inplace operation" error (a test pins this).
Never saved: the dense B·A, fp32 copies of anything [T, d_out].

Gradients (detached norm, DESIGN §4), dy_g = g ⊙ dy, t = dy_g B:
  dm = Σ_t dy ⊙ inner / n,  dB = s·dy_gᵀ h,  dA = s·tᵀ x_d,  dbias = Σ_t dy
  dx = dy_g W + s·t A                                     (no dropout)
  dx = dy W,  dx_d = ((g − 1) ⊙ dy) W + s·t A              (dropout; autograd maps dx_d to x)
  dn = −g ⊙ dm where n ≥ eps (used when n carries a gradient: exact_norm_grad)
"""

from __future__ import annotations

import torch

from . import config
from .compose import compose, compose_dropout, magnitude_scale
from .matmul import mm_out

SAVE_NONE, SAVE_INNER, SAVE_RECOVER = 0, 1, 2


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


# ------------------------------------------------------------------------------- forward
def forward_core(x, x_d, weight, a, b, magnitude, norm, bias, scaling, impl, save):
    """The forward computation with the adapters a [r, d_in], b [d_out, r] already in x's
    dtype. Returns (y, h, inner or None)."""
    x_in = x if x_d is None else x_d
    h = torch.mm(x_in, a.t())
    base = torch.mm(x, weight.t())
    base_d = base if x_d is None else torch.mm(x_d, weight.t())
    if impl == "fused":
        from .kernels.compose import compose_forward

        y, inner = compose_forward(
            h,
            b,
            base_d,
            magnitude,
            norm,
            scaling,
            bias,
            base=None if x_d is None else base,
            store_inner=save == SAVE_INNER,
        )
        return y, h, inner
    lora = torch.mm(h, b.t())
    if x_d is None:
        y = compose(base, lora, magnitude, norm, scaling, bias)
    else:
        y = compose_dropout(base, base_d, lora, magnitude, norm, scaling, bias)
    inner = None
    if save == SAVE_INNER:
        inner = (base_d.float() + scaling * lora.float()).to(x.dtype)
    return y, h, inner


def forward_impl(
    x: torch.Tensor,
    x_d: torch.Tensor | None,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: float,
    impl: str,
    save: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of the ``linear_forward`` custom op: casts the adapters, then ``forward_core``."""
    dt = x.dtype
    y, h, inner = forward_core(
        x, x_d, weight, lora_A.to(dt), lora_B.to(dt), magnitude, norm, bias, scaling, impl, save
    )
    return y, h, (_empty(y) if inner is None else inner)


linear_forward = torch.library.custom_op(
    "dora_torch::linear_forward", forward_impl, mutates_args=()
)


@linear_forward.register_fake
def _(x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, scaling, impl, save):
    T, d_out, r = x.shape[0], weight.shape[0], lora_A.shape[0]
    y = x.new_empty((T, d_out))
    inner = x.new_empty((T, d_out)) if save == SAVE_INNER else x.new_empty(0)
    return y, x.new_empty((T, r)), inner


# ------------------------------------------------------------------------------ backward
def backward_core(
    dy, x, x_d, weight, a, b, magnitude, norm, bias, h, saved, scaling, impl, recover,
    need_dx, need_dn, need_dbias, dA_dtype, dB_dtype,
):  # fmt: skip
    """The backward computation with a, b in x's dtype; dA, dB come back in dA_dtype, dB_dtype.
    Returns (dx, dx_d, dA, dB, dm, dn, dbias), empty tensors for what was not asked for."""
    dt = x.dtype
    acc = torch.promote_types(dt, torch.float32)  # fp32 accumulation; fp64 stays fp64
    dropout = x_d is not None
    need_dbias = need_dbias and bias is not None  # a frozen bias (the usual case) costs nothing
    dy = dy.to(dt)
    if impl == "fused":
        from .kernels.backward import scale_reduce

        dyg, dyg1, dm, dbias = scale_reduce(
            dy,
            saved,
            magnitude,
            norm,
            recover=recover,
            dropout=dropout,
            need_dbias=need_dbias,
            x=x,
            weight=weight,
            h=h,
            lora_B=b,
            scaling=scaling,
        )
    else:
        if recover:
            raise ValueError("the eager tier always saves inner (save=1), never recovers it")
        n = norm.to(acc).clamp_min(config.EPS)
        m = magnitude.to(acc)
        dyf = dy.to(acc)
        dm = (dyf * saved.to(acc)).sum(0) / n
        big = torch.finfo(dt).max  # saturate like the kernel (see kernels/backward.py)
        dyg = (dyf * (m / n)).clamp(-big, big).to(dt)
        dyg1 = (dyf * ((m - n) / n)).clamp(-big, big).to(dt) if dropout else None
        dbias = dyf.sum(0) if need_dbias else None

    x_in = x_d if dropout else x
    t = torch.mm(dyg, b)  # [T, r]
    dB = _scaled(mm_out(dyg.t(), h, acc), scaling).to(dB_dtype)
    dA = _scaled(mm_out(t.t(), x_in, acc), scaling).to(dA_dtype)
    dx, dx_d = _empty(x), _empty(x)
    if need_dx:
        # addmm_ in place: one [T, d_in] buffer per result, not two.
        if dropout:
            dx = torch.mm(dy, weight)
            dx_d = torch.mm(dyg1, weight).addmm_(t, a, alpha=scaling)
        else:
            dx = torch.mm(dyg, weight).addmm_(t, a, alpha=scaling)
    dn = _empty(norm)
    if need_dn:
        g = magnitude_scale(magnitude, norm)
        dn = torch.where(norm >= config.EPS, -g * dm, 0.0)
    return (
        dx,
        dx_d,
        dA,
        dB,
        dm.to(magnitude.dtype),
        dn,
        _empty(dy) if dbias is None else dbias.to(bias.dtype),
    )


def _scaled(t: torch.Tensor, s: float) -> torch.Tensor:
    return t if s == 1.0 else t.mul_(s)


def backward_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    x_d: torch.Tensor | None,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    bias: torch.Tensor | None,
    h: torch.Tensor,
    saved: torch.Tensor,
    scaling: float,
    impl: str,
    recover: bool,
    need_dx: bool,
    need_dn: bool,
    need_dbias: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """The body of the ``linear_backward`` custom op: casts the adapters, then ``backward_core``."""
    dt = x.dtype
    return backward_core(
        dy, x, x_d, weight, lora_A.to(dt), lora_B.to(dt), magnitude, norm, bias, h, saved,
        scaling, impl, recover, need_dx, need_dn, need_dbias, lora_A.dtype, lora_B.dtype,
    )  # fmt: skip


linear_backward = torch.library.custom_op(
    "dora_torch::linear_backward", backward_impl, mutates_args=()
)


@linear_backward.register_fake
def _(
    dy,
    x,
    x_d,
    weight,
    lora_A,
    lora_B,
    magnitude,
    norm,
    bias,
    h,
    saved,
    scaling,
    impl,
    recover,
    need_dx,
    need_dn,
    need_dbias,
):
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0)
    dx_d = x.new_empty(x.shape) if need_dx and x_d is not None else x.new_empty(0)
    dn = norm.new_empty(norm.shape) if need_dn else norm.new_empty(0)
    dbias = bias.new_empty(bias.shape) if need_dbias and bias is not None else dy.new_empty(0)
    return (
        dx,
        dx_d,
        lora_A.new_empty(lora_A.shape),
        lora_B.new_empty(lora_B.shape),
        magnitude.new_empty(magnitude.shape),
        dn,
        dbias,
    )


# ------------------------------------------------------------------------------ autograd
def _input_grads(need, x_d, bias, grads):
    """Map (dx, dx_d, dA, dB, dm, dn, dbias) onto the inputs
    (x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, ...): None where not needed."""
    dx, dx_d, dA, dB, dm, dn, dbias = grads
    return (
        dx if need[0] else None,
        dx_d if (need[1] and x_d is not None) else None,
        None,
        dA if need[3] else None,
        dB if need[4] else None,
        dm if need[5] else None,
        dn if need[6] else None,
        dbias if (need[7] and bias is not None) else None,
    )


def _setup_context(ctx, inputs, output):
    x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, scaling, impl, save = inputs
    y, h, inner = output
    saved = y if save == SAVE_RECOVER else inner
    ctx.save_for_backward(x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, h, saved)
    ctx.scaling, ctx.impl, ctx.save = scaling, impl, save


def _check_saved(ctx):
    if ctx.save == SAVE_NONE:
        raise RuntimeError(
            "dora_torch.linear_forward ran with save=0 (no gradient expected) but backward "
            "was called; call it through dora_torch.functional.dora_linear"
        )


def _custom_op_backward(ctx, dy, _dh, _dinner):
    _check_saved(ctx)
    x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, h, saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = linear_backward(
        dy, x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, h, saved, ctx.scaling,
        ctx.impl, ctx.save == SAVE_RECOVER, bool(need[0] or need[1]), bool(need[6]),
        bool(need[7]),
    )  # fmt: skip
    return (*_input_grads(need, x_d, bias, grads), None, None, None)


torch.library.register_autograd(
    "dora_torch::linear_forward", _custom_op_backward, setup_context=_setup_context
)


class LinearFunction(torch.autograd.Function):
    """The same forward/backward as the custom ops, without the custom-op dispatch.

    ``torch.library.custom_op`` dispatch costs host time on every eager call (run 2 on the
    H200: ~0.86 ms of the 2.35 ms host time of one fwd+bwd at 4096², 512 tokens, against
    0.27 ms of GPU work; benchmarks/NOTES.md), which dominates small layers. Eager calls
    therefore use this Function; compiled graphs use the custom ops
    (``dora_torch.functional`` picks). It also takes the adapters already cast to the
    activation dtype (``a``, ``b``: the module cache's casts) and saves those for backward,
    so nothing is recast per call; its only output is y.
    """

    @staticmethod
    def forward(ctx, x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, scaling, impl, save,
                a, b):  # fmt: skip
        y, h, inner = forward_core(x, x_d, weight, a, b, magnitude, norm, bias, scaling, impl, save)
        saved = y if save == SAVE_RECOVER else inner
        ctx.save_for_backward(x, x_d, weight, a, b, magnitude, norm, bias, h, saved)
        ctx.scaling, ctx.impl, ctx.save = scaling, impl, save
        ctx.grad_dtypes = (lora_A.dtype, lora_B.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        _check_saved(ctx)
        x, x_d, weight, a, b, magnitude, norm, bias, h, saved = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = backward_core(
            dy, x, x_d, weight, a, b, magnitude, norm, bias, h, saved, ctx.scaling, ctx.impl,
            ctx.save == SAVE_RECOVER, bool(need[0] or need[1]), bool(need[6]), bool(need[7]),
            *ctx.grad_dtypes,
        )  # fmt: skip
        return (*_input_grads(need, x_d, bias, grads), None, None, None, None, None)
