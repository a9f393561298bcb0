"""Every implementation of one DoRA linear layer on the same weights and inputs.

``run_all(case, dtype)`` returns, per backend, the output and the gradients of
``sum(dy * y)`` w.r.t. x, A, B, m and bias — all as float64 NumPy in PyTorch layout —
plus the fp64 spec reference evaluated on the inputs after casting them to ``dtype``.

Backends: ``torch_dense`` (plain dense torch DoRA, the torch baseline), ``peft``
(Hugging Face PEFT's DoRA layer), ``torch_<tier>`` for every dora_torch tier,
``jax_naive`` (plain dense jnp DoRA, the JAX baseline) and ``jax_<impl>`` for every
dora_jax impl.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

import dora_torch
import shared_spec as S
from dora_jax.baselines import naive_dora_dense
from dora_jax.functional import dora_dense
from shared_spec.cases import Case
from tests.torch.helpers import dense_baseline

TORCH_TIERS = ("eager", "fused")
JAX_IMPLS = ("xla",)  # the Mosaic compose tiles none of these cases: tests/jax/test_mosaic.py
NAMES = ("x", "A", "B", "m", "bias")
JAX_DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}
# On the GPU machine the torch tiers run on CUDA (the fused tier needs it there); on CPU CI
# the fused tier runs through the Triton interpreter (tests/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _np(t):
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return t.detach().double().cpu().numpy()
    return np.asarray(jnp.asarray(t, jnp.float32), np.float64)


def _torch_run(fn, inputs, dy):
    leaves = {
        k: v.detach().clone().requires_grad_(True) for k, v in inputs.items() if v is not None
    }
    y = fn(**{k: leaves.get(k) for k in inputs})
    y.backward(dy)
    return _np(y), {k: _np(leaves[k].grad) if k in leaves else None for k in NAMES}


def _peft_layer(case: Case, W, bias, dtype):
    from peft import LoraConfig, get_peft_model

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(W.shape[1], W.shape[0], bias=bias is not None, dtype=dtype)

    holder = Holder().to(W.device)
    with torch.no_grad():
        holder.proj.weight.copy_(W)
        if bias is not None:
            holder.proj.bias.copy_(bias)
    alpha = 2.0 * case.r if case.alpha is None else case.alpha
    cfg = LoraConfig(r=case.r, lora_alpha=alpha, use_rslora=case.use_rslora, use_dora=True,
                     target_modules=["proj"])  # fmt: skip
    # Adapters in the working dtype: PEFT's bf16 setting, so it is a same-dtype baseline.
    return get_peft_model(holder, cfg, autocast_adapter_dtype=False).base_model.model.proj


def run_all(case: Case, dtype: torch.dtype, *, seed: int = 0, peft: bool = True):
    """{backend: (y, grads)} and the reference ``(y, grads)``; see the module doc."""
    d = case.make(seed)
    raw = dict(x=d.x, W=d.W, A=d.A, B=d.B, m=d.m, bias=d.bias, dy=d.dy)
    t = {k: None if v is None else torch.tensor(v, dtype=dtype, device=DEVICE)
         for k, v in raw.items()}  # fmt: skip
    s, W, dy = d.scaling, t["W"], t["dy"]
    c = {k: _np(v) for k, v in t.items()}
    ref_y = S.dora_linear(c["x"], c["W"], c["A"], c["B"], c["m"], s, c["bias"])
    g = S.dora_linear_vjp(c["x"], c["W"], c["A"], c["B"], c["m"], s, c["dy"], c["bias"])
    ref = (ref_y, dict(x=g.dx, A=g.dA, B=g.dB, m=g.dm, bias=g.dbias))

    inputs = {k: t[k] for k in NAMES}
    out = {
        "torch_dense": _torch_run(
            lambda x, A, B, m, bias: dense_baseline(x, W, A, B, m, s, bias), inputs, dy
        )
    }
    for tier in TORCH_TIERS:
        out[f"torch_{tier}"] = _torch_run(
            lambda x, A, B, m, bias, tier=tier: dora_torch.dora_linear(
                x, W, A, B, m, s, bias, impl=tier
            ),
            inputs,
            dy,
        )
    if peft:
        layer = _peft_layer(case, W, t["bias"], dtype)

        def peft_fn(x, A, B, m, bias):
            # PEFT owns its Parameters: load the leaves' values, then read their grads back.
            with torch.no_grad():
                layer.lora_A["default"].weight.copy_(A)
                layer.lora_B["default"].weight.copy_(B)
                layer.lora_magnitude_vector["default"].weight.copy_(m)
            return layer(x)

        y, grads = _torch_run(peft_fn, {"x": t["x"], "A": t["A"], "B": t["B"], "m": t["m"],
                                        "bias": None}, dy)  # fmt: skip
        grads.update(  # PEFT's bias is frozen: no dbias to compare
            A=_np(layer.lora_A["default"].weight.grad),
            B=_np(layer.lora_B["default"].weight.grad),
            m=_np(layer.lora_magnitude_vector["default"].weight.grad),
        )
        out["peft"] = (y, grads)

    jdt = JAX_DTYPES[dtype]
    kernel, lora_a, lora_b = (jnp.asarray(v, jdt) for v in S.to_flax_layout(d.W, d.A, d.B))
    jx, jm, jdy = (jnp.asarray(v, jdt) for v in (d.x, d.m, d.dy))
    jbias = None if d.bias is None else jnp.asarray(d.bias, jdt)

    def jax_run(fn):
        @jax.jit  # one compilation instead of one per eager op (CPU CI time)
        def fwd_bwd(*args):
            y, pull = jax.vjp(fn, *args)
            return y, pull(jdy)

        y, (dx, da, db, dm, dbias) = fwd_bwd(jx, lora_a, lora_b, jm, jbias)
        _, dA, dB = S.from_flax_layout(_np(kernel), _np(da), _np(db))
        return _np(y), dict(x=_np(dx), A=dA, B=dB, m=_np(dm), bias=_np(dbias))

    out["jax_naive"] = jax_run(
        lambda x, a, b, m, bias: naive_dora_dense(x, kernel, a, b, m, s, bias)
    )
    for impl in JAX_IMPLS:
        out[f"jax_{impl}"] = jax_run(
            lambda x, a, b, m, bias, impl=impl: dora_dense(x, kernel, a, b, m, s, bias, impl=impl)
        )
    return out, ref
