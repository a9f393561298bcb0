"""torch.library registration: opcheck, and torch.compile(fullgraph=True) on the CPU."""

from __future__ import annotations

import pytest
import torch

import dora_torch
from dora_torch import ops

from .helpers import random_case_tensors


def _op_args(impl, *, bias=True, dropout=False, save=ops.SAVE_INNER, grad=True):
    x, W, A, B, m, b, s = random_case_tensors(21, d_in=20, d_out=18, r=3)
    n = dora_torch.factored_norm(W, A, B, s).detach()
    xd = torch.nn.functional.dropout(x, 0.5, training=True) if dropout else None
    leaves = [t.requires_grad_(grad) for t in (x, A, B, m)]
    return (
        leaves[0],
        xd,
        W,
        leaves[1],
        leaves[2],
        leaves[3],
        n,
        b if bias else None,
        s,
        impl,
        save,
    )


@pytest.mark.parametrize(
    ("bias", "dropout", "save"),
    [(True, False, ops.SAVE_INNER), (False, False, ops.SAVE_RECOVER), (True, True, ops.SAVE_INNER)],
)
@pytest.mark.parametrize("impl", ["eager", "fused"])
def test_opcheck_forward(impl, bias, dropout, save):
    if impl == "eager" and save == ops.SAVE_RECOVER:
        save = ops.SAVE_INNER
    args = _op_args(impl, bias=bias, dropout=dropout, save=save)
    torch.library.opcheck(torch.ops.dora_torch.linear_forward.default, args)


def test_opcheck_inference_mode_op():
    args = _op_args("eager", save=ops.SAVE_NONE, grad=False)
    torch.library.opcheck(torch.ops.dora_torch.linear_forward.default, args)


def _fn(impl):
    def f(x, W, A, B, m, b, s):
        return dora_torch.dora_linear(x, W, A, B, m, s, b, impl=impl)

    return f


@pytest.mark.parametrize("exact", [False, True])
def test_compile_fullgraph_functional(exact):
    torch._dynamo.reset()
    x, W, A, B, m, b, s = random_case_tensors(22, lead=(2, 3))

    def f(x, A, B, m):
        return dora_torch.dora_linear(x, W, A, B, m, s, b, impl="eager", exact_norm_grad=exact)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_(True) for t in (x, A, B, m)]
    leaves2 = [t.clone().requires_grad_(True) for t in (x, A, B, m)]
    y = compiled(*leaves)
    y_ref = f(*leaves2)
    torch.testing.assert_close(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    for a, r in zip(leaves, leaves2):
        torch.testing.assert_close(a.grad, r.grad)


def test_compile_fullgraph_module():
    torch._dynamo.reset()
    layer = dora_torch.Linear(24, 20, r=4, lora_alpha=8, impl="eager")
    x = torch.randn(3, 24)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x))
