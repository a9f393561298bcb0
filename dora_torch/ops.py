"""The DoRA linear's one autograd path: ``LinearFunction`` (eager calls and compiled graphs).

    y, (saved for backward) = LinearFunction.apply(x, x_d?, W, A, B, m, n, bias?, a, b, F?, opts)

x [T, d_in] and W [d_out, d_in] share the activation dtype; A [r, d_in], B [d_out, r] and m
may be fp32 (PEFT's default); a, b are A and B cast to the activation dtype (a module cache
casts them once per parameter update) and their gradients come back in A's and B's own
dtype. n is the detached norm in the compute dtype (fp32; float64 for float64 inputs).
F = [W; a] or None: the stacked weights (``dora_torch.stacking``) whose rows W and a are;
the fused tier then forms x Fᵀ = [base | h] and dx = [dy_g | s·t] F, one GEMM each.
x_d = dropout(x) or None (PEFT's dropout form, docs/design.md §1). ``opts`` is a frozen
``LinearOptions``: the scaling, the tier ("fused": Triton compose / backward kernels around
cuBLAS GEMMs; "eager": the same algorithm in torch ops), what is saved for backward, and
whether a fused call's forward runs as the eager tier's torch ops (compiled training
graphs: ``config.COMPILED_TORCH_COMPOSE`` "forward", or "auto" at high ranks).

Dynamo traces this Function (forward and backward), and on CUDA it captures the Triton
launches inside (user-defined Triton kernels), so ``torch.compile(fullgraph=True)`` sees one
graph; eager calls pay no custom-op dispatch, and enter it through ``apply_linear``.

What is saved for backward (``opts.save``):
  SAVE_NONE     nothing (no gradient needed; ``inner`` is never formed);
  SAVE_INNER    inner = x_d Wᵀ + s·h Bᵀ rounded to the activation dtype, stored over the
                base product's buffer (it stays alive until backward; without dropout y then
                needs its own buffer); without saving, the fused forward writes y over that
                buffer, so it allocates nothing beyond the cuBLAS products;
  SAVE_RECOVER  nothing new: inner is recovered in backward as y / g from the output y, which
                the next op usually keeps alive anyway. Used by the fused tier only when it is
                numerically sound: bf16/fp32 activations (fp16's narrow exponent range makes
                small g·inner subnormal), no bias (y − b would cancel when |b| ≫ |g·inner|)
                and no dropout (y is not g·inner there). Columns with g = 0 (m_i = 0) lost
                inner; the kernel that finishes dm recomputes it from x, W, h, B there,
                without a host sync. Modifying y in place before backward raises autograd's
                "modified by an inplace operation" error (a test pins this).
  SAVE_RECOMPUTE nothing new: backward recomputes inner = x_d Wᵀ + s·h Bᵀ from x_d (or x),
                W, h and B, which it keeps anyway, in one [T, d_out] buffer that lives only
                during this layer's backward: one more GEMM of the base product's size, in
                exchange for LoRA's saved tensors exactly (``recompute_inner``; for layers
                whose output the next op does not keep, where SAVE_RECOVER holds y alive
                only for this backward). Rounded like SAVE_INNER's inner (fp32 sum, one
                rounding; the eager tier rounds s·h Bᵀ first, as its forward does).
Never saved: the dense B·A, fp32 copies of anything [T, d_out].

Gradients (detached norm, docs/design.md §4), dy_g = g ⊙ dy, t = dy_g B:
  dm = Σ_t dy ⊙ inner / n,  dB = s·dy_gᵀ h,  dA = s·tᵀ x_d,  dbias = Σ_t dy
  dx = dy_g W + s·t A                                     (no dropout)
     = [dy_g | s·t] F                                      (stacked: one GEMM, F = [W; a])
  dx = dy W,  dx_d = ((g − 1) ⊙ dy) W + s·t A              (dropout; autograd maps dx_d to x)
  dn = −g ⊙ dm where n ≥ eps (used when n carries a gradient: exact_norm_grad)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import config
from .compose import compose, compose_dropout, magnitude_scale, magnitude_scale_minus_one
from .kernels.backward import scale_reduce
from .kernels.compose import compose_forward
from .matmul import addmm_inplace, as_dtype, compute_dtype, scaled_mm

SAVE_NONE, SAVE_INNER, SAVE_RECOVER, SAVE_RECOMPUTE = 0, 1, 2, 3


@dataclass(frozen=True)
class LinearOptions:
    """What one call computes: s, the tier ("fused" | "eager"), the save mode, and whether
    the fused tier's forward runs as torch ops (``torch_forward``: the eager tier's products
    and composition, for Inductor to fuse, before the fused backward)."""

    scaling: float
    impl: str
    save: int
    torch_forward: bool = False

    @staticmethod
    def of(scaling: float, impl: str, save: int, torch_forward: bool = False) -> LinearOptions:
        """The shared instance for these values (a model has a few distinct ones; building a
        frozen dataclass per layer call cost host time)."""
        if torch.compiler.is_compiling():  # no global state inside a traced graph
            return LinearOptions(scaling, impl, save, torch_forward)
        key = (scaling, impl, save, torch_forward)
        opts = _OPTIONS.get(key)
        if opts is None:
            if len(_OPTIONS) >= 1024:
                _OPTIONS.clear()
            opts = _OPTIONS[key] = LinearOptions(*key)
        return opts


_OPTIONS: dict[tuple, LinearOptions] = {}


# ------------------------------------------------------------------------------- forward
def forward_core(x, x_d, weight, a, b, magnitude, norm, bias, opts: LinearOptions, stacked=None):
    """The forward with a [r, d_in], b [d_out, r] in x's dtype. Returns (y, h, inner|None).
    ``stacked``: F = [W; a] (fused tier, no dropout), or None; used here when
    ``config.STACK_FORWARD`` is on (backward uses it either way)."""
    scaling = opts.scaling
    if stacked is not None:
        check_stacked(opts, x_d)
    if stacked is not None and config.STACK_FORWARD:
        # One GEMM for base and h; both are column views of it, y is written over base.
        d_out = weight.shape[0]
        base, h = torch.mm(x, stacked.t()).split_with_sizes((d_out, a.shape[0]), 1)
        y, inner = compose_forward(
            h, b, base, magnitude, norm, scaling, bias, store_inner=opts.save == SAVE_INNER
        )
        return y, h, inner
    x_in = x if x_d is None else x_d
    h = torch.mm(x_in, a.t())
    base = torch.mm(x, weight.t())
    base_d = base if x_d is None else torch.mm(x_d, weight.t())
    if opts.impl == "fused" and not opts.torch_forward:
        y, inner = compose_forward(
            h,
            b,
            base_d,
            magnitude,
            norm,
            scaling,
            bias,
            base=None if x_d is None else base,
            store_inner=opts.save == SAVE_INNER,
        )
        return y, h, inner
    lora = torch.mm(h, b.t())
    if x_d is None:
        y = compose(base, lora, magnitude, norm, scaling, bias)
    else:
        y = compose_dropout(base, base_d, lora, magnitude, norm, scaling, bias)
    inner = _eager_inner(base_d, lora, scaling) if opts.save == SAVE_INNER else None
    return y, h, inner


def check_stacked(opts: LinearOptions, x_d) -> None:
    """Stacked weights serve the fused tier without dropout, saving inner or recovering it."""
    if opts.impl != "fused" or x_d is not None or opts.save == SAVE_RECOMPUTE:
        raise ValueError(
            "stacked weights need impl='fused', no dropout and save != SAVE_RECOMPUTE; got "
            f"impl={opts.impl!r}, dropout={x_d is not None}, save={opts.save}"
        )


def _eager_inner(base_d, lora, scaling):
    """The eager tier's inner = base_d + s·lora: summed in the compute dtype, rounded once to
    the activation dtype (lora = h Bᵀ already rounded to it)."""
    acc = compute_dtype(base_d.dtype)
    return (base_d.to(acc) + scaling * lora.to(acc)).to(base_d.dtype)


def recompute_inner(x_in, weight, h, b, opts: LinearOptions):
    """inner = x_in Wᵀ + s·h Bᵀ in the activation dtype, as the forward of ``opts`` rounds it
    (SAVE_RECOMPUTE): the fused tier's kernel forward in one cuBLAS call with beta = 1 over
    the base product (fp32 accumulation, one rounding, as the compose kernel stores it); the
    eager tier and a torch forward (``opts.torch_forward``) by ``_eager_inner``."""
    base_d = torch.mm(x_in, weight.t())
    if opts.impl == "fused" and not opts.torch_forward:
        return addmm_inplace(base_d, h, b.t(), opts.scaling)
    return _eager_inner(base_d, torch.mm(h, b.t()), opts.scaling)


# ------------------------------------------------------------------------------ backward
def backward_core(
    dy, x, x_d, weight, a, b, magnitude, norm, bias, h, saved, opts: LinearOptions, *,
    need_dx, need_dn, need_dbias, dA_dtype, dB_dtype, stacked=None,
):  # fmt: skip
    """The backward with a, b in x's dtype; dA, dB come back in dA_dtype, dB_dtype.
    ``stacked`` as in ``forward_core``. Returns (dx, dx_d, dA, dB, dm, dn, dbias), None for
    what was not asked for."""
    dt = x.dtype
    acc = compute_dtype(dt)  # fp32 accumulation; fp64 stays fp64
    scaling, recover = opts.scaling, opts.save == SAVE_RECOVER
    dropout = x_d is not None
    x_in = x_d if dropout else x  # the adapter's input
    need_dbias = need_dbias and bias is not None  # a frozen bias (the usual case) costs nothing
    if dy.dtype != dt:
        dy = dy.to(dt)
    if opts.save == SAVE_RECOMPUTE:
        saved = recompute_inner(x_in, weight, h, b, opts)
    rows = rows_g = rows_t = None
    if stacked is not None:  # dy_g and s·t side by side: [dy_g | s·t] F is dx in one GEMM
        check_stacked(opts, x_d)
        rows = torch.empty((dy.shape[0], stacked.shape[0]), dtype=dt, device=dy.device)
        rows_g, rows_t = rows.split_with_sizes((dy.shape[1], a.shape[0]), 1)
    if opts.impl == "fused":
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
            # dn needs dm unrounded; otherwise dm is stored in m's dtype (no cast launch)
            dm_dtype=torch.float32 if need_dn else magnitude.dtype,
            out=rows_g,
        )
    else:
        if recover:
            raise ValueError("the eager tier always saves inner (save=1), never recovers it")
        dyf = dy.to(acc)
        dm = (dyf * saved.to(acc)).sum(0) / norm.to(acc).clamp_min(config.EPS)
        big = torch.finfo(dt).max  # saturate like the kernel (see kernels/backward.py)
        dyg = (dyf * magnitude_scale(magnitude, norm)).clamp(-big, big).to(dt)
        dyg1 = None
        if dropout:
            dyg1 = (dyf * magnitude_scale_minus_one(magnitude, norm)).clamp(-big, big).to(dt)
        dbias = dyf.sum(0) if need_dbias else None

    dB = scaled_mm(dyg.t(), h, scaling, _grad_dtype(dB_dtype, dt, acc))
    dx = dx_d = None
    if rows is not None:
        st = rows_t.addmm_(dyg, b, beta=0.0, alpha=scaling)  # s·t [T, r]
        dA = scaled_mm(st.t(), x_in, 1.0, _grad_dtype(dA_dtype, dt, acc))
        if need_dx:
            dx = torch.mm(rows, stacked)
    else:
        t = torch.mm(dyg, b)  # [T, r]
        dA = scaled_mm(t.t(), x_in, scaling, _grad_dtype(dA_dtype, dt, acc))
        # In place: one [T, d_in] buffer per result, not two, and no copy.
        if need_dx and dropout:
            dx = torch.mm(dy, weight)
            dx_d = addmm_inplace(torch.mm(dyg1, weight), t, a, scaling)
        elif need_dx:
            dx = addmm_inplace(torch.mm(dyg, weight), t, a, scaling)
    dn = None
    if need_dn:
        g = magnitude_scale(magnitude, norm)
        dn = torch.where(norm >= config.EPS, -g * dm, 0.0).to(norm.dtype)
    return (
        dx,
        dx_d,
        as_dtype(dA, dA_dtype),
        as_dtype(dB, dB_dtype),
        as_dtype(dm, magnitude.dtype),
        dn,
        None if dbias is None else as_dtype(dbias, bias.dtype),
    )


def _grad_dtype(param_dtype: torch.dtype, dt: torch.dtype, acc: torch.dtype) -> torch.dtype:
    """The dtype an adapter-gradient GEMM writes: the parameter's own when the GEMM produces
    it with one rounding (the activation dtype dt or the compute dtype acc), else acc (cast
    to the parameter's dtype once afterwards)."""
    return param_dtype if param_dtype in (dt, acc) else acc


# ------------------------------------------------------------------------------ autograd
class LinearFunction(torch.autograd.Function):
    """The DoRA linear with the detached-norm backward above; its only output is y.

    Inputs: (x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, a, b, stacked, opts).
    lora_A and lora_B are the parameters (gradients flow to them, in their dtype); a and b
    their casts to x's dtype, which are saved for backward so nothing is recast per call
    (with ``stacked`` = F, W and a are F's rows; they are saved too, so that autograd's
    version checks see writes to them).
    """

    @staticmethod
    def forward(ctx, x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, a, b, stacked, opts):
        y, h, inner = forward_core(x, x_d, weight, a, b, magnitude, norm, bias, opts, stacked)
        saved = y if opts.save == SAVE_RECOVER else inner
        ctx.save_for_backward(x, x_d, weight, a, b, magnitude, norm, bias, h, saved, stacked)
        ctx.opts = opts
        ctx.grad_dtypes = (lora_A.dtype, lora_B.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.opts.save == SAVE_NONE:
            raise RuntimeError(
                "dora_torch's LinearFunction ran with save=SAVE_NONE (no gradient expected) "
                "but backward was called; call it through dora_torch.functional.dora_linear"
            )
        x, x_d, weight, a, b, magnitude, norm, bias, h, saved, stacked = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dx_d, dA, dB, dm, dn, dbias = backward_core(
            dy, x, x_d, weight, a, b, magnitude, norm, bias, h, saved, ctx.opts,
            need_dx=need[0] or need[1], need_dn=need[6], need_dbias=need[7],
            dA_dtype=ctx.grad_dtypes[0], dB_dtype=ctx.grad_dtypes[1], stacked=stacked,
        )  # fmt: skip
        return (
            dx if need[0] else None,
            dx_d if need[1] else None,
            None,
            dA if need[3] else None,
            dB if need[4] else None,
            dm if need[5] else None,
            dn if need[6] else None,
            dbias if need[7] else None,
            None,
            None,
            None,
            None,
        )


#: Autograd's C entry for ``LinearFunction``, the call ``Function.apply`` ends in.
_C_APPLY = super(torch.autograd.Function, LinearFunction).apply


def apply_linear(x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, a, b, stacked, opts):
    """``LinearFunction.apply(...)`` for ``functional._run``, its arguments in that order.

    Eager calls outside ``torch.func`` transforms go straight to autograd's C entry.
    ``Function.apply``'s Python costs ~2 µs of host time per layer call
    (benchmarks/NOTES.md, session 36): a setup-context lookup, and a scan of every argument
    for wrappers of exited ``torch.func`` levels, which it unwraps. That scan finds none
    here. Each argument is a dispatcher op's output (x reshaped, its dropout, the casts and
    products), and dispatcher ops unwrap such wrappers themselves; or it is a module's
    parameter, or a cache entry. A cache entry computed inside a transform is keyed on that
    transform's wrappers, so it is never read outside one. Traced code and active transforms
    take ``Function.apply``.
    """
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return LinearFunction.apply(
            x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, a, b, stacked, opts
        )
    return _C_APPLY(x, x_d, weight, lora_A, lora_B, magnitude, norm, bias, a, b, stacked, opts)
