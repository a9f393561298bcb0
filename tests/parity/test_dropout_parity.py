"""Adapter dropout: dora_jax and dora_torch agree with the same mask (fp32, every gradient)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import shared_spec as S
from dora_jax.functional import dora_dense, dropout_mask
from shared_spec.cases import get

RATE = 0.3
KEY = jax.random.key(5)


@pytest.mark.parametrize("exact", [False, True], ids=["detached", "exact"])
@pytest.mark.parametrize("case_name", ["batched_3d", "magnitude_perturbed", "rslora"])
def test_jax_dropout_matches_torch_with_the_same_mask(case_name, exact, monkeypatch):
    d = get(case_name).make(0)
    f32 = [None if v is None else np.asarray(v, np.float32) for v in (d.x, d.W, d.A, d.B, d.m)]
    x, W, A, B, m = f32
    bias = None if d.bias is None else np.asarray(d.bias, np.float32)
    dy = np.asarray(d.dy, np.float32)
    mask = np.array(dropout_mask(KEY, RATE, x.shape)).reshape(-1, x.shape[-1])

    # dora_torch draws its mask with F.dropout on x as [T, d_in]: give it the JAX mask
    def same_mask_dropout(x2, p, training=True):
        return torch.where(torch.from_numpy(mask), x2 / (1.0 - p), torch.zeros_like(x2))

    torch_functional = importlib.import_module("dora_torch.functional")
    monkeypatch.setattr(torch_functional, "F", SimpleNamespace(dropout=same_mask_dropout))
    tx, tA, tB, tm = (torch.tensor(v, requires_grad=True) for v in (x, A, B, m))
    tb = None if bias is None else torch.tensor(bias, requires_grad=True)
    ty = torch_functional.dora_linear(
        tx, torch.tensor(W), tA, tB, tm, d.scaling, tb, dropout_p=RATE, training=True,
        impl="eager", exact_norm_grad=exact,
    )  # fmt: skip
    ty.backward(torch.tensor(dy))
    torch_out = [ty.detach(), tx.grad, tA.grad.T, tB.grad.T, tm.grad]
    torch_out += [] if tb is None else [tb.grad]

    k, a, b = S.to_flax_layout(W, A, B)

    def f(x, a, b, m, bias):
        return dora_dense(x, k, a, b, m, d.scaling, bias, impl="xla", exact_norm_grad=exact,
                          dropout_rate=RATE, dropout_rng=KEY, deterministic=False)  # fmt: skip

    primals = [jnp.asarray(v) for v in (x, a, b, m)] + [None if bias is None else jnp.asarray(bias)]
    y, pull = jax.vjp(f, *primals)
    jax_out = [y, *pull(jnp.asarray(dy))][: len(torch_out)]
    for name, u, v in zip(("y", "dx", "dA", "dB", "dm", "dbias"), jax_out, torch_out):
        v = v.numpy()
        scale = float(np.abs(v).max()) or 1.0
        np.testing.assert_allclose(np.asarray(u), v, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
