"""``swiglu(gate, up, x)``: silu(gate(x)) · up(x), with one backward pass for two DoRA layers.

A SwiGLU MLP (Llama's gate_proj / up_proj) ends its backward, in each DoRA layer, with the
scale-and-reduce over [T, d_out] (g ⊙ dy and Σ_t dy ⊙ inner: ``xla_ops.scale_reduce``, or
``mosaic.scale_reduce``) right after the SwiGLU derivative (docs/design.md §4.1). XLA runs
that work as two or three passes whatever form the backward is written in
(benchmarks/NOTES.md, session 26). ``swiglu`` puts
both layers and the activation under one custom_vjp whose backward runs
``mosaic.swiglu_backward``: d_act and both layers' saved inner read once, both scaled cotangents
written once; the GEMMs that follow are each layer's own (``vjp.layer_grads``). The forward is
the two layers' forward unchanged.

The pair is fused where the kernel applies, and otherwise the two layers run as written:
both layers ``DoraDense``, unmerged, without bias, adapter dropout, a frozen norm, the exact
norm gradient or a sharded norm; one kernel shape; bf16 activations; and the layers' ``impl``
resolving to "mosaic" for the ``"swiglu"`` op (``config.resolve_impl``: "mosaic" on every shape
the kernel tiles, "auto" where ``AUTO_MOSAIC`` says it wins on the H200).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import mosaic
from .checks import check_input
from .config import current_platform, resolve_impl
from .dense import DoraDense
from .vjp import (
    GRADS_SCOPE,
    REDUCE_SCOPE,
    Options,
    layer_forward,
    layer_grads,
    saved_and_g,
    takes_scaled_cotangent,
)


def swiglu(gate, up, x, *, deterministic: bool | None = None, rngs=None):
    """``jax.nn.silu(gate(x)) * up(x)`` for two layers (any callables; DoraDense layers get
    ``deterministic`` and ``rngs``). With two DoRA layers that the fused backward takes (module
    docstring) the same value with the gradients of one SwiGLU backward pass; otherwise
    exactly the unfused expression."""
    pair = _fusable(gate, up, x)
    if pair is None:
        return jax.nn.silu(_call(gate, x, deterministic, rngs)) * _call(up, x, deterministic, rngs)
    opts_g, opts_u, cd = pair
    lead, d_in = x.shape[:-1], x.shape[-1]
    args = [jnp.asarray(x, cd).reshape(-1, d_in)]
    for layer in (gate, up):
        args += [
            layer.kernel.get_value().astype(cd),
            layer.lora_a.get_value(),
            layer.lora_b.get_value(),
            layer.magnitude.get_value(),
        ]
    args += [None if layer.base_sq is None else layer.base_sq.get_value() for layer in (gate, up)]
    out = swiglu_core(opts_g, opts_u, *args)
    return out.reshape(*lead, out.shape[-1])


def _call(layer, x, deterministic, rngs):
    if isinstance(layer, DoraDense):
        return layer(x, deterministic=deterministic, rngs=rngs)
    return layer(x)


def _fusable(gate, up, x):
    """(Options of gate, of up, compute dtype) when the pair takes the fused backward, else None."""
    layers = (gate, up)
    if not all(isinstance(layer, DoraDense) for layer in layers):
        return None
    if any(
        layer.merged
        or layer.bias is not None
        or layer.lora_dropout
        or layer.frozen_norm is not None
        or layer.exact_norm_grad
        or layer._norm_sharding() is not None
        for layer in layers
    ):
        return None
    shape = gate.kernel.get_value().shape
    if up.kernel.get_value().shape != shape or len(shape) != 2:
        return None
    cd = jnp.dtype(gate._compute_dtype(x))
    if cd != jnp.dtype(up._compute_dtype(x)) or cd != jnp.dtype(jnp.bfloat16):
        return None
    d_in, d_out = shape
    check_input(x, d_in)
    tokens = math.prod(x.shape[:-1])
    platform = current_platform()
    opts = []
    for layer in layers:
        r = int(layer.lora_a.get_value().shape[1])
        impl = resolve_impl(
            layer.impl, "swiglu", platform=platform, shape=(tokens, d_in, d_out, r), dtype=cd
        )
        if impl != "mosaic":
            return None
        opts.append(
            Options(
                scaling=float(layer.scaling),
                exact_norm_grad=False,
                compose_impl="xla",  # the kernel reads the saved inner of the XLA compose
                interpret=platform != "gpu",
                chunk_size=None,
            )
        )
    return opts[0], opts[1], cd


def _pair_forward(opts_g, opts_u, x, kg, ag, bg, mg, ku, au, bu, mu, sq_g, sq_u, perturbed):
    pg, pu = perturbed
    yg, packed_g = layer_forward(opts_g, x, kg, ag, bg, mg, sq_g, perturbed=pg)
    yu, packed_u = layer_forward(opts_u, x, ku, au, bu, mu, sq_u, perturbed=pu)
    return jax.nn.silu(yg) * yu, (packed_g, packed_u)


_UNPERTURBED = ((False,) * 5, (False,) * 5)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def swiglu_core(opts_g: Options, opts_u: Options, x, kg, ag, bg, mg, ku, au, bu, mu, sq_g, sq_u):
    """silu(y_gate) · y_up of two DoRA layers on x [T, d_in] (kernels in x's dtype; base_sq
    each f32 [d_out] or None); the backward of the module docstring."""
    args = (x, kg, ag, bg, mg, ku, au, bu, mu, sq_g, sq_u)
    return _pair_forward(opts_g, opts_u, *args, _UNPERTURBED)[0]


def _fwd(opts_g, opts_u, x, kg, ag, bg, mg, ku, au, bu, mu, sq_g, sq_u):
    def val(p):
        return None if p is None else p.value

    def pert(p):
        return p is not None and p.perturbed

    perturbed = (
        (pert(x), pert(kg), pert(ag), pert(bg), pert(mg)),
        (pert(x), pert(ku), pert(au), pert(bu), pert(mu)),
    )
    args = [val(p) for p in (x, kg, ag, bg, mg, ku, au, bu, mu, sq_g, sq_u)]
    act, (packed_g, packed_u) = _pair_forward(opts_g, opts_u, *args, perturbed)
    for opts, packed in ((opts_g, packed_g), (opts_u, packed_u)):
        if not takes_scaled_cotangent(opts, packed):  # _fusable admits only layers that do
            raise ValueError("swiglu_core: a layer's backward needs its own cotangent")
    return act, (packed_g, packed_u)


def _bwd(opts_g, opts_u, res, d_act):
    if isinstance(d_act, SymbolicZero):
        return (None,) * 11
    packed_g, packed_u = res
    saved_g, g_g = saved_and_g(packed_g)
    saved_u, g_u = saved_and_g(packed_u)
    with jax.named_scope(REDUCE_SCOPE):
        dy_g_gate, dy_g_up, col_gate, col_up = mosaic.swiglu_backward(
            d_act.astype(saved_g.dtype), saved_g, saved_u, g_g, g_u, interpret=opts_g.interpret
        )
    with jax.named_scope(GRADS_SCOPE):
        cg = layer_grads(opts_g, packed_g, None, dy_g_gate, col_gate)
        cu = layer_grads(opts_u, packed_u, None, dy_g_up, col_up)
        parts = [d for d in (cg[0], cu[0]) if d is not None]
        dx = None if not parts else functools.reduce(jnp.add, parts)
    return (dx, cg[2], cg[3], cg[4], cg[5], cu[2], cu[3], cu[4], cu[5], None, None)


swiglu_core.defvjp(_fwd, _bwd, symbolic_zeros=True)
