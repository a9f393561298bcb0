"""GPU tests (H200): every tier against the spec and PEFT on CUDA, bf16 and fp32.

Skipped without CUDA (tests/conftest.py). Shapes include ones that are not multiples of any
block and ranks below tl.dot's minimum of 16.
"""

from __future__ import annotations

import pytest
import torch

import dora_torch
from shared_spec import cases

from .helpers import check_tier

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
GPU_CASES = [n for n in cases.CASES]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("impl", ["eager", "fused"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_cuda_tier_matches_spec(case, impl, dtype):
    check_tier(case, DTYPES[dtype], impl, device="cuda")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("case", ["odd_shapes", "zero_base_row", "rslora"])
def test_cuda_exact_and_dropout(case, dtype):
    check_tier(case, DTYPES[dtype], "fused", device="cuda", exact=True)
    check_tier(case, DTYPES[dtype], "fused", device="cuda", dropout_p=0.2)


@pytest.mark.parametrize("epilogue", [True, False])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(
    ("d_in", "d_out", "r", "T"),
    [(1000, 1500, 24, 333), (512, 769, 7, 1030), (2048, 1024, 384, 257), (256, 256, 1, 64)],
)
def test_cuda_big_odd_shapes_match_eager_in_fp64(d_in, d_out, r, T, dtype, epilogue):
    """Larger, non-block-multiple shapes (exercise autotuned tiles and masks) vs fp64 eager."""
    from dora_torch import config

    dt = DTYPES[dtype]
    torch.manual_seed(0)
    x = torch.randn(T, d_in, device="cuda")
    W = torch.randn(d_out, d_in, device="cuda") / d_in**0.5
    A = torch.randn(r, d_in, device="cuda") / d_in**0.5
    B = torch.randn(d_out, r, device="cuda") / (2 * r**0.5)
    m = torch.rand(d_out, device="cuda") + 0.5
    dy = torch.randn(T, d_out, device="cuda")
    before = config.COMPOSE_IN_GEMM_EPILOGUE
    config.COMPOSE_IN_GEMM_EPILOGUE = epilogue
    try:
        outs = {}
        for tag, d in (("ours", dt), ("ref", torch.float64)):
            # copy=True: for fp32 `.to` would return the tensor itself, so the reference pass
            # would see non-leaf inputs (views of the first pass's leaves) and no .grad.
            leaves = [t.to(d, copy=True).requires_grad_(True) for t in (x, A, B, m)]
            impl = "fused" if tag == "ours" else "eager"
            y = dora_torch.dora_linear(leaves[0], W.to(d), *leaves[1:3], leaves[3], 2.0, impl=impl)
            y.backward(dy.to(d))
            outs[tag] = [y.detach()] + [t.grad for t in leaves]
    finally:
        config.COMPOSE_IN_GEMM_EPILOGUE = before
    tol = 2e-2 if dt == torch.bfloat16 else 1e-4
    for name, a, b in zip(["y", "dx", "dA", "dB", "dm"], outs["ours"], outs["ref"]):
        err = (a.double() - b).norm() / b.norm()
        assert err < tol, f"{name}: rel err {err:.3g}"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_matches_peft(dtype):
    peft = pytest.importorskip("peft")
    import copy

    from torch import nn

    dt = DTYPES[dtype]
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(300, 200)).to("cuda", dt)
    ours = dora_torch.Linear.from_linear(
        copy.deepcopy(base[0]), r=16, lora_alpha=32, adapter_dtype=dt, impl="fused"
    )
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(r=16, lora_alpha=32, use_dora=True, target_modules=["0"]),
        autocast_adapter_dtype=False,
    )
    layer = model.base_model.model[0]
    with torch.no_grad():
        ours.lora_B.normal_(0, 0.05)
        layer.lora_A["default"].weight.copy_(ours.lora_A)
        layer.lora_B["default"].weight.copy_(ours.lora_B)
        layer.lora_magnitude_vector["default"].weight.copy_(ours.lora_magnitude_vector)
    x = torch.randn(4, 77, 300, device="cuda", dtype=dt)
    for train in (False, True):
        model.train(train)
        ours.train(train)
        y_ref, y = model(x), ours(x)
        assert ours.last_impl == "fused"
        tol = {"rtol": 2e-2, "atol": 2e-2} if dt == torch.bfloat16 else {}
        torch.testing.assert_close(y, y_ref, **tol)
    y.float().square().sum().backward()
    y_ref.float().square().sum().backward()
    pairs = [
        (ours.lora_A, layer.lora_A["default"].weight),
        (ours.lora_B, layer.lora_B["default"].weight),
        (ours.lora_magnitude_vector, layer.lora_magnitude_vector["default"].weight),
    ]
    for a, b in pairs:
        err = (a.grad.double() - b.grad.double()).norm() / b.grad.double().norm()
        assert err < (3e-2 if dt == torch.bfloat16 else 1e-4)


def test_cuda_compile_fullgraph_fused():
    torch._dynamo.reset()
    layer = dora_torch.Linear(512, 384, r=16, lora_alpha=32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, layer(x), rtol=1e-2, atol=1e-2)
    y.float().sum().backward()
    assert layer.lora_A.grad is not None


def test_cuda_opcheck_fused():
    from dora_torch import ops

    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(80, 96, device="cuda", dtype=torch.bfloat16)
    A = torch.randn(8, 96, device="cuda", requires_grad=True)
    B = torch.randn(80, 8, device="cuda", requires_grad=True)
    m = torch.rand(80, device="cuda", requires_grad=True)
    n = dora_torch.factored_norm(W, A, B, 2.0).detach()
    for bias, save in ((None, ops.SAVE_RECOVER), (torch.randn(80, device="cuda"), ops.SAVE_INNER)):
        torch.library.opcheck(
            torch.ops.dora_torch.linear_forward.default,
            (x, None, W, A, B, m, n, bias, 2.0, "fused", save),
        )


@pytest.mark.parametrize("method", ["kernel", "gemm"])
@pytest.mark.parametrize(("d_out", "r"), [(8193, 384), (1000, 7), (4096, 16)])
def test_cuda_norm_assembly_methods_match_fp64(method, d_out, r):
    """Both fused norm assemblies (config.NORM_ASSEMBLY) on odd shapes vs float64 torch."""
    from dora_torch.kernels.norm import assemble_norm

    torch.manual_seed(0)
    U = torch.randn(d_out, r, device="cuda") * 0.1  # keeps every n² well above 0
    B = torch.randn(d_out, r, device="cuda") * 0.1
    A = torch.randn(r, 256, device="cuda") / 16
    G = A @ A.t()
    base_sq = torch.rand(d_out, device="cuda") + 1.0
    Bd, Ud, Gd = B.double(), U.double(), G.double()
    want = (base_sq.double() + (Bd * (4.0 * Ud + 4.0 * (Bd @ Gd))).sum(1)).clamp_min(0).sqrt()
    got = assemble_norm(base_sq, U, B, G, 2.0, method=method)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_zero_magnitude_columns_recompute_inner(dtype):
    """No bias, no dropout: the fused backward recovers inner from y, except in columns with
    m = 0, where its kernel recomputes x W_iᵀ + s·h B_iᵀ (odd shape, zeros in two blocks)."""
    dt = DTYPES[dtype]
    torch.manual_seed(0)
    T, d_in, d_out, r = 300, 777, 1000, 24
    x = torch.randn(T, d_in, device="cuda")
    W = torch.randn(d_out, d_in, device="cuda") / d_in**0.5
    A = torch.randn(r, d_in, device="cuda") / d_in**0.5
    B = torch.randn(d_out, r, device="cuda") / (2 * r**0.5)
    m = torch.rand(d_out, device="cuda") + 0.5
    m[[3, 640, 999]] = 0.0
    dy = torch.randn(T, d_out, device="cuda")
    grads = {}
    for tag, d, impl in (("ours", dt, "fused"), ("ref", torch.float64, "eager")):
        mm = m.to(d, copy=True).requires_grad_(True)
        y = dora_torch.dora_linear(x.to(d), W.to(d), A.to(d), B.to(d), mm, 2.0, impl=impl)
        y.backward(dy.to(d))
        grads[tag] = mm.grad.double()
    zeros = [3, 640, 999]
    assert torch.all(grads["ref"][zeros] != 0)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-4
    err = (grads["ours"] - grads["ref"]).norm() / grads["ref"].norm()
    assert err < tol, f"dm rel err {err:.3g}"
    err0 = (grads["ours"][zeros] - grads["ref"][zeros]).norm() / grads["ref"][zeros].norm()
    assert err0 < tol, f"dm rel err at m = 0 columns {err0:.3g}"
