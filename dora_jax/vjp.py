"""The DoRA layer as a ``jax.custom_vjp`` on 2-D inputs (Flax layout); ``functional`` wraps it.

Forward (docs/design.md §1, §2), with cd the activation dtype and acc = promote_types(f32, cd) (f32
for bf16/f16/f32 activations, f64 for f64 ones with ``jax_enable_x64``); "f32" below means acc:

    n = ||K + s·a·b||_col          factored (U = aᵀK, G = aᵀa), acc, or given precomputed
    g = m / max(n, eps)            acc
    h = x·a (cd),  base = x·K (cd)
    y = g ⊙ (base + s·h·b) + bias  (g applied in acc; Mosaic rounds once, XLA rounds inner
                                    first)

Backward (docs/design.md §4) with dy_g = g ⊙ dy and ``saved`` the [T, N] activation the forward
kept (``inner`` = base + s·h·b from the XLA compose, or ``base`` from the Mosaic one, whose
fused epilogue never materialises inner):

    dm = (Σ_t dy ⊙ inner) / n
    db = s·hᵀ·dy_g,   q = s·dy_g·bᵀ [T, r],   da = xᵀ·q,   dx = dy_g·Kᵀ + q·aᵀ,   dK = xᵀ·dy_g

db is formed as the spec and dora_torch form it, so every GEMM of the backward reads dy_g and
dy's one reader is the elementwise scale-and-reduce pass; no [r, N] pass scales P by g
(benchmarks/NOTES.md, session 23: −0.3 ms per 8-layer r = 16 step). Two exceptions take
db = s·P ⊙ g with P = hᵀ·dy [r, N] instead: f16 activations, whose dy_g saturates (below)
long before f32 would overflow, so a zero column's db (g ≈ m/eps) would be lost; and
``base`` saved, where Σ_t dy ⊙ inner = Σ_t dy ⊙ base + s·Σ_k b ⊙ P needs P anyway.

dy_g is saturated at ±finfo(cd).max when rounded to cd (g ≈ m/eps on a zero column overflows
f16, and inf · 0 in the GEMMs would be NaN), as dora_torch does.

The norm is a constant unless ``exact_norm_grad``; then, with c = (dL/dn)/n (zero where n was
clamped by eps), the terms through n are added:

    db += c ⊙ (s·U + s²·G·b),   da += s·K·(b ⊙ c)ᵀ + s²·a·((b ⊙ c)·bᵀ),   dK += c ⊙ (K + s·a·b)

Residuals: x (and x_d), h [T, r], saved [T, N], f32 vectors [N], and only with
``exact_norm_grad`` one f32 [r, N] matrix w = s·U + s²·G·b (U and G themselves are never kept,
G·b never recomputed); never a [d_in, N] temporary. Transposed products are written as
``dot_general`` contractions, so the program holds no transpose of the kernel or the adapters
(XLA would fold them, but the lowered program need not rely on it).

Adapter dropout (PEFT's form, docs/design.md §1): x_d = dropout(x) [T, d_in] is an input of its own,
computed outside by the caller as a differentiable function of x; then h = x_d·a, the compose
always runs in XLA (``xla_ops.compose``), g1 = g − 1 = (m − n)/n is formed in f32, and

    y = x·K + g1 ⊙ (x_d·K) + g ⊙ s·h·b + bias,   inner = x_d·K + s·h·b (saved; dm, c as above)
    dy_g1 = g1 ⊙ dy,  dx = dy·Kᵀ,  dx_d = dy_g1·Kᵀ + q·aᵀ,  da = x_dᵀ·q,  dK = xᵀ·dy + x_dᵀ·dy_g1

so the formulas above hold with the adapter's input x_d in place of x and dy_g1 in place of dy_g
on the base product of x_d; the exact-norm terms are unchanged (dy/dn is −g/n ⊙ inner in both).
JAX's autograd maps dx_d back through the dropout onto x.

Gradients are computed only for inputs JAX marks as perturbed (symbolic zeros), so a frozen
kernel costs no dK GEMM even without jit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import mosaic, xla_ops
from .config import acc_dtype, dot_precision
from .norm import norm_parts
from .sharding import NormSharding, sharded_norm_parts
from .xla_ops import magnitude_scale, magnitude_scale_minus_one, norm_is_clamped, safe_norm

_CONTRACT_0 = (((0,), (0,)), ((), ()))  # aᵀ·b without a transpose
_CONTRACT_1 = (((1,), (1,)), ((), ()))  # a·bᵀ without a transpose


@dataclass(frozen=True)
class Options:
    """Static (hashable) configuration of one call; the impls of the compose and of the
    backward's scale-and-reduce are already resolved ("mosaic" or "xla"; the norm always runs
    in XLA)."""

    scaling: float
    exact_norm_grad: bool
    compose_impl: str
    interpret: bool  # run the Mosaic kernels in Pallas' GPU interpreter
    chunk_size: int | None
    norm_sharding: NormSharding | None = None  # the norm as a shard_map (dora_jax.sharding)
    reduce_impl: str = "xla"  # the backward's scale-and-reduce (``_bwd``)


#: Name scopes of a layer's parts. They reach the optimized HLO's op names, so a profile can
#: put every kernel of a step under one of them (``benchmarks/profile_jax.py``).
NORM_SCOPE = "dora_norm"  # U, G, the assembly, g = m / n
COMPOSE_SCOPE = "dora_compose"  # x·a, x·K and the compose
REDUCE_SCOPE = "dora_scale_reduce"  # the backward's cotangent pass (one layer or a SwiGLU pair)
GRADS_SCOPE = "dora_grads"  # the backward's GEMMs and small sums (``layer_grads``)


def _norm_parts(opts: Options, kernel, lora_a, lora_b, base_sq):
    """(n, w): the factored norm and, with exact_norm_grad, w = s·U + s²·G·b for the backward."""
    if opts.norm_sharding is not None:
        fn = functools.partial(sharded_norm_parts, sharding=opts.norm_sharding)
    else:
        fn = norm_parts
    return fn(
        kernel,
        lora_a,
        lora_b,
        base_sq,
        scaling=opts.scaling,
        chunk_size=opts.chunk_size,
        grad_parts=opts.exact_norm_grad,
    )


def _base_product(x, kernel):
    """x·K with both operands behind one optimization barrier.

    XLA's GPU dot merger rewrites products that share an operand (x·K beside x·a, and the
    q/k/v projections' x·K) as one GEMM over the concatenated right-hand sides, and that
    concatenation copies the frozen kernel on every call: 130 µs per decoder layer at r = 384
    for ~10 µs of GEMM efficiency (benchmarks/NOTES.md, session 24). Behind the barrier x·K's
    left operand is a value of its own, so the kernel is never copied. The barrier holds the
    pair (x, K), not x alone: identical barriers of x alone are merged by CSE, and the q/k/v
    products would share an operand again. x and K are GEMM inputs either way, so nothing is
    materialised that was not already.
    """
    x, kernel = lax.optimization_barrier((x, kernel))
    return jnp.dot(x, kernel)


def _forward(opts: Options, x, x_d, kernel, lora_a, lora_b, magnitude, bias, base_sq, norm):
    """Returns (y, residuals). x [T, d_in], x_d (like x, or None: no dropout) and kernel
    [d_in, N] share the activation dtype."""
    acc = acc_dtype(x.dtype)
    with jax.named_scope(NORM_SCOPE):
        if norm is None:
            n, w = _norm_parts(opts, kernel, lora_a, lora_b, base_sq)
        else:
            n, w = norm, None
        n = n.astype(acc)
        g = magnitude_scale(magnitude, n, acc)
    with jax.named_scope(COMPOSE_SCOPE):
        y, h, saved, saved_is_inner = _compose(
            opts, x, x_d, kernel, lora_a, lora_b, magnitude, bias, g, n
        )
    res = (x, x_d, kernel, lora_a, lora_b, magnitude, bias, h, saved, g, n, w)
    return y, (res, saved_is_inner)


def _compose(opts: Options, x, x_d, kernel, lora_a, lora_b, magnitude, bias, g, n):
    """(y, h, saved, saved_is_inner): the adapter product h = x·a (x_d·a with dropout), the
    base product and their compose (``_forward``)."""
    cd = x.dtype
    acc = acc_dtype(cd)
    s = opts.scaling
    a_c, b_c = lora_a.astype(cd), lora_b.astype(cd)
    h = jnp.dot(x if x_d is None else x_d, a_c, preferred_element_type=cd)  # f32 acc, one round
    base = _base_product(x, kernel)
    if opts.compose_impl == "mosaic" and x_d is None:
        y = mosaic.compose(base, h, b_c, g, bias, scaling=s, interpret=opts.interpret)
        saved, saved_is_inner = base, False
    else:
        dropout = (
            None
            if x_d is None
            else (_base_product(x_d, kernel), magnitude_scale_minus_one(magnitude, n, acc))
        )
        y, saved = xla_ops.compose(
            base, h, b_c, g, bias, scaling=s, precision=dot_precision(cd), dropout=dropout
        )
        saved_is_inner = True
    return y, h, saved, saved_is_inner


def layer_forward(opts: Options, x, kernel, lora_a, lora_b, magnitude, base_sq, *, perturbed):
    """(y, packed residuals for ``layer_grads``) of one layer without dropout, bias or a frozen
    norm, for a custom_vjp that spans several layers (``dora_jax.swiglu``); ``perturbed``:
    whether (x, kernel, lora_a, lora_b, magnitude) need cotangents."""
    y, (res, saved_is_inner) = _forward(
        opts, x, None, kernel, lora_a, lora_b, magnitude, None, base_sq, None
    )
    px, pk, pa, pb, pm = perturbed
    return y, (res, _Flags((px, False, pk, pa, pb, pm, False), saved_is_inner))


@jax.tree_util.register_static
@dataclass(frozen=True)
class _Flags:
    """Static facts the backward needs: which inputs are perturbed, what the forward saved."""

    perturbed: tuple[bool, ...]  # x, x_d, kernel, lora_a, lora_b, magnitude, bias
    saved_is_inner: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dora_core(opts: Options, x, x_d, kernel, lora_a, lora_b, magnitude, bias, base_sq, norm):
    """DoRA forward on x [T, d_in]; see the module docstring. Returns [T, N] in x's dtype.

    x_d: None, or x after adapter dropout (same shape and dtype), which the adapter then reads.
    kernel must already be in x's dtype; lora_a/lora_b/magnitude/bias keep their own dtypes
    (their gradients come back in them, accumulated in f32). base_sq and norm (f32 [N] or None)
    are constants: they get no gradient.
    """
    return _forward(opts, x, x_d, kernel, lora_a, lora_b, magnitude, bias, base_sq, norm)[0]


def _fwd(opts: Options, x, x_d, kernel, lora_a, lora_b, magnitude, bias, base_sq, norm):
    def val(p):
        return None if p is None else p.value

    y, (res, saved_is_inner) = _forward(
        opts,
        *(val(p) for p in (x, x_d, kernel, lora_a, lora_b, magnitude, bias, base_sq, norm)),
    )
    perturbed = tuple(
        p is not None and p.perturbed for p in (x, x_d, kernel, lora_a, lora_b, magnitude, bias)
    )
    if norm is not None and (perturbed[3] or perturbed[4]):
        # A precomputed norm is a snapshot of (kernel, lora_a, lora_b): differentiating the
        # adapters means an optimizer step will change them and the snapshot would go stale
        # without notice. Frozen norms are for inference with frozen adapters.
        raise ValueError(
            "norm= (a frozen norm) was given while lora_a/lora_b are differentiated; it would "
            "go stale after the next optimizer step. Train without a frozen norm "
            "(DoraDense.clear_cache())."
        )
    return y, (res, _Flags(perturbed, saved_is_inner))


def _bwd(opts: Options, packed, dy):
    if isinstance(dy, SymbolicZero):
        return (None,) * 9
    saved, g = saved_and_g(packed)
    with jax.named_scope(REDUCE_SCOPE):
        if opts.reduce_impl == "mosaic":
            dy_g, col = mosaic.scale_reduce(dy, saved, g, interpret=opts.interpret)
        else:
            dy_g, col = xla_ops.scale_reduce(dy, saved, g)
    with jax.named_scope(GRADS_SCOPE):
        return layer_grads(opts, packed, dy, dy_g, col)


def saved_and_g(packed):
    """(saved [T, d_out], g [d_out]) of a layer's packed residuals: what its scale-and-reduce
    reads besides dy (saved is inner, or base after the Mosaic compose)."""
    res = packed[0]
    return res[8], res[9]


def takes_scaled_cotangent(opts: Options, packed) -> bool:
    """Whether ``layer_grads`` of this layer needs only (dy_g, Σ_t dy ⊙ inner), not dy itself:
    inner saved, no dropout, no bias gradient, not f16 (whose db takes hᵀ·dy), not the exact
    norm gradient. A fused pass that forms both (``mosaic.swiglu_backward``) can then stand
    in for ``xla_ops.scale_reduce``."""
    res, flags = packed
    x, x_d, bias = res[0], res[1], res[6]
    narrow = jnp.finfo(x.dtype).maxexp < jnp.finfo(acc_dtype(x.dtype)).maxexp
    return (
        flags.saved_is_inner
        and x_d is None
        and bias is None
        and not narrow
        and not opts.exact_norm_grad
    )


def layer_grads(opts: Options, packed, dy, dy_g, col):
    """The layer's cotangents (``dora_core``'s inputs, in order) from dy, dy_g = g ⊙ dy and
    col = Σ_t dy ⊙ saved (module docstring). dy may be None where ``takes_scaled_cotangent``."""
    res, flags = packed
    px, pxd, pk, pa, pb, pm, pbias = flags.perturbed
    saved_is_inner = flags.saved_is_inner
    x, x_d, kernel, lora_a, lora_b, magnitude, bias, h, _, g, n, w = res
    cd = x.dtype
    acc = acc_dtype(cd)
    s = opts.scaling
    exact = opts.exact_norm_grad
    n_safe = safe_norm(n, acc)
    b_c = lora_b.astype(cd)
    a_c = lora_a.astype(cd)
    if dy is None and not takes_scaled_cotangent(opts, packed):
        raise ValueError("layer_grads needs dy for this layer (takes_scaled_cotangent is False)")
    # The adapter's input and the cotangent of its base product: (x, dy_g), or with dropout
    # (x_d, dy_g1); the base product of x itself then takes plain dy.
    dropout = x_d is not None
    x_in = x_d if dropout else x
    if dropout:
        dy_k = xla_ops.saturating_scale(dy, magnitude_scale_minus_one(magnitude, n, acc), acc)
    else:
        dy_k = dy_g
    need_dx_in = pxd if dropout else px

    # Σ_t dy ⊙ inner; with base saved, the LoRA part comes from P = hᵀ·dy, which db then reuses.
    # db from dy_g only where dy_g's saturation cannot bind before acc's range (not f16).
    narrow = jnp.finfo(cd).maxexp < jnp.finfo(acc).maxexp
    p = None
    need_db = pb or exact
    if (need_db and narrow) or (not saved_is_inner and (need_db or pm)):
        p = lax.dot_general(h, dy, _CONTRACT_0, preferred_element_type=acc)
    inner_dot = None
    if pm or exact:
        inner_dot = col if saved_is_inner else col + s * jnp.sum(b_c.astype(acc) * p, axis=0)

    dx = dx_d = dk = da = db = dm = dbias = None
    if pm:
        dm = (inner_dot / n_safe).astype(magnitude.dtype)
    if pbias:
        dbias = jnp.sum(dy.astype(acc), axis=0).astype(bias.dtype)
    if pb or exact:
        if p is None:
            db = s * lax.dot_general(h, dy_g, _CONTRACT_0, preferred_element_type=acc)
        else:
            db = s * p * g[None, :]
    if pa or need_dx_in:
        q = (s * lax.dot_general(dy_g, b_c, _CONTRACT_1, preferred_element_type=acc)).astype(cd)
        if pa:
            da = lax.dot_general(x_in, q, _CONTRACT_0, preferred_element_type=acc)
        if need_dx_in:
            dx_in = lax.dot_general(dy_k, kernel, _CONTRACT_1) + lax.dot_general(
                q, a_c, _CONTRACT_1
            )
            if dropout:
                dx_d = dx_in
            else:
                dx = dx_in
    if dropout and px:
        dx = lax.dot_general(dy, kernel, _CONTRACT_1)
    if pk:
        dk = lax.dot_general(x_in, dy_k, _CONTRACT_0, preferred_element_type=acc)
        if dropout:
            dk = dk + lax.dot_general(x, dy, _CONTRACT_0, preferred_element_type=acc)

    if exact:
        dn = -(magnitude.astype(acc) / (n_safe * n_safe)) * inner_dot
        c = jnp.where(norm_is_clamped(n), 0.0, dn / n_safe)
        bc = b_c.astype(acc) * c[None, :]  # [r, N]
        prec = dot_precision(cd)
        if pb:
            db = db + c[None, :] * w
        if pa:
            # (b ⊙ c)·bᵀ contracts over N: activation-dtype operands, f32 accumulation (as kbc)
            bbt = lax.dot_general(
                bc.astype(cd), b_c, _CONTRACT_1, precision=prec, preferred_element_type=acc
            )
            kbc = lax.dot_general(kernel, bc.astype(cd), _CONTRACT_1, preferred_element_type=acc)
            da = da + s * kbc + s * s * jnp.dot(lora_a.astype(acc), bbt, precision=prec)
        if pk:
            dk = (
                dk
                + kernel.astype(acc) * c[None, :]
                + s * jnp.dot(a_c, bc.astype(cd), preferred_element_type=acc)
            )

    def cast(v, like, wanted):
        return None if (v is None or not wanted) else v.astype(like.dtype)

    return (
        cast(dx, x, px),
        cast(dx_d, x, pxd),
        cast(dk, kernel, pk),
        cast(da, lora_a, pa),
        cast(db, lora_b, pb),
        dm,
        dbias,
        None,
        None,
    )


dora_core.defvjp(_fwd, _bwd, symbolic_zeros=True)
