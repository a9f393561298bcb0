"""Reliability of dora_torch's public API: float64 that is float64, PEFT's adapter-dtype rule,
constructors that fail without a trace, errors that name the argument."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import dora_torch
from shared_spec import linear as spec

from .helpers import random_case_tensors


def _f64_case(seed=31, lead=(3, 5), d_in=20, d_out=17, r=3):
    x, W, A, B, m, b, s = random_case_tensors(seed, lead=lead, d_in=d_in, d_out=d_out, r=r)
    return (*(t.double() for t in (x, W, A, B, m, b)), s)


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("impl", ["eager", "auto"])
def test_float64_forward_and_every_gradient_match_the_spec_to_1e12(impl):
    x, W, A, B, m, b, s = _f64_case()
    leaves = [t.clone().requires_grad_(True) for t in (x, A, B, m, b)]
    xs, As, Bs, ms, bs = leaves
    y = dora_torch.dora_linear(xs, W, As, Bs, ms, s, bs, impl=impl)
    assert y.dtype == torch.float64
    dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y.backward(dy)
    npy = {k: t.detach().numpy() for k, t in dict(x=x, W=W, A=A, B=B, m=m, b=b).items()}
    args = (npy["x"], npy["W"], npy["A"], npy["B"], npy["m"], s)
    want = spec.dora_linear(*args, npy["b"])
    assert _rel(y.detach(), want) <= 1e-12
    grads = spec.dora_linear_vjp(*args, dy.numpy(), npy["b"])
    for name, leaf in zip(("dx", "dA", "dB", "dm", "dbias"), leaves):
        assert _rel(leaf.grad, getattr(grads, name)) <= 1e-12, name


def test_float64_module_norm_and_cache_are_float64():
    layer = dora_torch.Linear(20, 17, r=3, lora_alpha=5, dtype=torch.float64)
    assert layer.lora_A.dtype == layer.lora_magnitude_vector.dtype == torch.float64
    with torch.no_grad():
        layer.lora_B.normal_()
    n = layer.norm()
    assert n.dtype == torch.float64
    V = layer.weight + layer.scaling * layer.lora_B @ layer.lora_A
    assert _rel(n.detach(), torch.linalg.vector_norm(V, dim=1).detach()) <= 1e-14


@pytest.mark.parametrize("impl", ["eager", "auto"])
def test_gradcheck_float64(impl):
    """Finite differences see the norm's dependence on A and B, so this checks the exact
    gradient (exact_norm_grad=True); the detached default is checked against the spec above.
    float64 runs the eager tier (the fused kernels are fp16/bf16/fp32: see the next test)."""
    x, W, A, B, m, b, s = _f64_case(lead=(4,), d_in=6, d_out=5, r=2)
    leaves = tuple(t.clone().requires_grad_(True) for t in (x, A, B, m, b))

    def f(x, A, B, m, b):
        return dora_torch.dora_linear(x, W, A, B, m, s, b, impl=impl, exact_norm_grad=True)

    assert torch.autograd.gradcheck(f, leaves)


def test_gradcheck_fused_tier_in_fp32_against_finite_differences_of_the_eager_tier():
    """The fused tier has no float64 kernels: check its VJP against the float64 eager tier
    (which gradcheck validated) at fp32 precision, through the interpreter on CPU."""
    x, W, A, B, m, b, s = random_case_tensors(33, lead=(6,), d_in=24, d_out=20, r=4)
    leaves = [t.clone().requires_grad_(True) for t in (x, A, B, m, b)]
    y = dora_torch.dora_linear(leaves[0], W, *leaves[1:4], s, leaves[4], impl="fused")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad(y, leaves, dy)
    ref = [t.detach().double().requires_grad_(True) for t in (x, A, B, m, b)]
    y64 = dora_torch.dora_linear(ref[0], W.double(), *ref[1:4], s, ref[4], impl="eager")
    grads64 = torch.autograd.grad(y64, ref, dy.double())
    for g, g64 in zip(grads, grads64):
        assert _rel(g.double(), g64) <= 1e-5


@pytest.mark.parametrize(
    ("base", "adapter_dtype", "want"),
    [
        (torch.float64, None, torch.float64),
        (torch.float32, None, torch.float32),
        (torch.bfloat16, None, torch.float32),
        (torch.float16, None, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float64, torch.float32, torch.float32),
    ],
)
def test_adapter_dtype_follows_peft(base, adapter_dtype, want):
    layer = dora_torch.Linear.from_linear(
        nn.Linear(8, 6, dtype=base), r=2, lora_alpha=4, adapter_dtype=adapter_dtype
    )
    for p in (layer.lora_A, layer.lora_B, layer.lora_magnitude_vector):
        assert p.dtype == want


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lora_alpha": float("nan")}, ValueError, "lora_alpha must be finite"),
        ({"lora_alpha": math.inf}, ValueError, "lora_alpha must be finite"),
        ({"lora_alpha": "8"}, TypeError, "lora_alpha must be a Python number"),
        ({"lora_alpha": True}, TypeError, "lora_alpha"),
        ({"adapter_dtype": torch.int8}, TypeError, "adapter_dtype"),
        ({"adapter_dtype": "float32"}, TypeError, "adapter_dtype"),
        ({"r": 0}, ValueError, "r must be a positive int"),
        ({"lora_dropout": 1.0}, ValueError, "lora_dropout"),
        ({"impl": "cuda"}, ValueError, "impl"),
        ({"use_rslora": "yes"}, TypeError, "use_rslora"),
    ],
)
def test_from_linear_is_atomic(kwargs, error, match):
    base = nn.Linear(8, 6)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    args = {"r": 2, "lora_alpha": 4, **kwargs}
    with pytest.raises(error, match=match):
        dora_torch.Linear.from_linear(base, **args)
    assert base.weight.requires_grad and base.bias.requires_grad  # not frozen
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k])
    assert not hasattr(base, "lora_A")


def _accelerated_tiny():
    from tests.parity.models import peft_dora, tiny_llama

    model = peft_dora(tiny_llama())
    dora_torch.accelerate_peft(model)
    return next(m for m in model.modules() if hasattr(m, "_dora_norm_cache"))


@pytest.mark.parametrize("bad", [[[1.0] * 8], torch.tensor(1.0), np.ones(8, np.float32)])
def test_non_tensor_or_scalar_inputs_name_x(bad):
    layer = dora_torch.Linear(8, 6, r=2, lora_alpha=4)
    _, W, A, B, m, b, s = random_case_tensors(5, d_in=8, d_out=6, r=2)
    calls = [
        lambda: layer(bad),
        lambda: dora_torch.dora_linear(bad, W, A, B, m, s, b),
    ]
    for call in calls:
        with pytest.raises((TypeError, ValueError), match=r"\bx\b"):
            call()
    layer.merge()
    with pytest.raises((TypeError, ValueError), match=r"\bx\b"):
        layer(bad)


def test_accelerated_peft_layer_names_x():
    layer = _accelerated_tiny()
    with pytest.raises(TypeError, match=r"\bx\b"):
        layer([[1.0] * 32])
    with pytest.raises(ValueError, match=r"\bx\b"):
        layer(torch.tensor(1.0))


def _layer_grads(layer, x, run):
    layer.zero_grad(set_to_none=True)
    xl = x.clone().requires_grad_(True)
    y = run(layer, xl)
    y.square().sum().backward()
    params = (layer.lora_A, layer.lora_B, layer.lora_magnitude_vector)
    return [y.detach(), xl.grad] + [p.grad for p in params]


@pytest.mark.parametrize("impl", ["eager", "fused"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_plain_gradients(impl, reentrant):
    """Inside ``torch.utils.checkpoint`` (both modes) the layer's forward runs twice, the
    second time during backward; output and gradients are the plain call's, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    device = "cpu"
    if impl == "fused" and not dora_torch.config.interpreting():
        if not torch.cuda.is_available():
            pytest.skip("the fused tier needs CUDA or the Triton interpreter")
        device = "cuda"
    torch.manual_seed(0)
    base = nn.Linear(12, 10, device=device)
    layer = dora_torch.Linear.from_linear(base, r=3, lora_alpha=6, impl=impl)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(2, 5, 12, device=device)
    want = _layer_grads(layer, x, lambda m, t: m(t))
    got = _layer_grads(layer, x, lambda m, t: checkpoint(m, t, use_reentrant=reentrant))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
