"""GPU tests (H200): every tier against the spec and PEFT on CUDA, bf16 and fp32.

Skipped without CUDA (tests/conftest.py). Shapes include ones that are not multiples of any
block and ranks below tl.dot's minimum of 16.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import dora_torch
from shared_spec import cases
from shared_spec.tolerances import assert_close

from .helpers import check_tier, scale_reduce_inputs

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


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", GPU_CASES)
def test_cuda_recompute_inner_matches_spec(case, dtype):
    check_tier(case, DTYPES[dtype], "fused", device="cuda", recompute_inner=True)


@pytest.mark.parametrize("epilogue", [True, False])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(
    ("d_in", "d_out", "r", "T", "s"),
    [
        (1000, 1500, 24, 333, 1.7),
        (512, 769, 7, 1030, 0.5),
        (2048, 1024, 384, 257, 3.0),
        (256, 256, 1, 64, 1.7),
        # 17 × 17 tiles at r = 300: config.LORA_GEMM_SQUARE, masked in M, N and K
        (512, 2100, 300, 2100, 1.3),
    ],
)
def test_cuda_big_odd_shapes_match_spec(d_in, d_out, r, T, s, dtype, epilogue):
    """Larger, non-block-multiple shapes (exercise autotuned tiles and masks): the fused tier's
    output and every gradient against the float64 spec, with the shared tolerance rule."""
    from dora_torch import config

    case = cases.Case(
        f"big_{d_in}x{d_out}_r{r}", d_in=d_in, d_out=d_out, r=r, lead=(T,), alpha=s * r
    )
    before = config.COMPOSE_IN_GEMM_EPILOGUE
    config.COMPOSE_IN_GEMM_EPILOGUE = epilogue
    try:
        check_tier(case, DTYPES[dtype], "fused", device="cuda")
    finally:
        config.COMPOSE_IN_GEMM_EPILOGUE = before


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", [*GPU_CASES, "big"])
def test_cuda_one_pass_norm_matches_spec(case, dtype, monkeypatch):
    """kernels/norm_pass.py inside the fused layer: forward and every gradient against the
    float64 spec, tolerance rule."""
    from dora_torch import config

    monkeypatch.setattr(config, "NORM_PASS_MAX_RANK", 32)
    if case == "big":  # odd, non-block-multiple, r = 24 (a padded r-block)
        case = cases.Case("big_1000x1500_r24", d_in=1000, d_out=1500, r=24, lead=(333,), alpha=40)
    check_tier(case, DTYPES[dtype], "fused", device="cuda")


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


@pytest.mark.parametrize("s", [0.5, 1.7, 3.0])  # not 2: there 2s = s² hides swapped terms
@pytest.mark.parametrize("method", ["kernel", "gemm", "pairs", "auto"])
@pytest.mark.parametrize(("d_out", "r"), [(8193, 384), (1000, 7), (4096, 16), (3001, 300)])
@pytest.mark.parametrize("bf16x3", [False, True])
@pytest.mark.parametrize("b_dtype", [torch.float32, torch.bfloat16])
def test_cuda_norm_assembly_methods_match_fp64(method, d_out, r, s, bf16x3, b_dtype):
    """The fused norm assemblies (config.NORM_ASSEMBLY) on odd shapes vs float64 torch; for a
    16-bit layer (``bf16x3``) the gemm's and the pairs kernel's B·G are within their bound
    (kernels/norm.py), and "pairs" refuses any other layer."""
    from dora_torch.kernels.norm import assemble_norm

    torch.manual_seed(0)
    U = torch.randn(d_out, r, device="cuda") * 0.1  # keeps every n² well above 0
    B = (torch.randn(d_out, r, device="cuda") * 0.1).to(b_dtype)
    A = torch.randn(r, 256, device="cuda") / 16
    G = A @ A.t()
    base_sq = torch.rand(d_out, device="cuda") + 1.0
    Bd, Ud, Gd = B.double(), U.double(), G.double()
    sq = base_sq.double() + (Bd * (2 * s * Ud + s * s * (Bd @ Gd))).sum(1)
    want = sq.clamp_min(0).sqrt()
    if method == "pairs" and not bf16x3:
        with pytest.raises(ValueError, match="bf16x3=True"):
            assemble_norm(base_sq, U, B, G, s, method=method, bf16x3=bf16x3)
        return
    got = assemble_norm(base_sq, U, B, G, s, method=method, bf16x3=bf16x3).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    if bf16x3:  # the split's own bound on n², plus fp32 rounding
        slack = s * s * (Bd.abs() * (Bd.abs() @ Gd.abs())).sum(1) * 3 * 2.0**-16
        assert ((got**2 - sq).abs() <= slack + 1e-6 * sq).all()


@pytest.mark.parametrize("b_dtype", [torch.float32, torch.bfloat16])
def test_cuda_bf16x3_split_rounds_like_torch_and_compiles_alike(b_dtype):
    """The bf16 split kernel rounds as torch does, compiled (fullgraph) it gives the same
    bits, and the compiled bf16x3 B·G is eager's up to GEMM summation order (losing the lo
    halves, as a fused ``x.to(bf16)`` could, would cost ~1e-3)."""
    from dora_torch.kernels.norm import bg_bf16x3, split_bf16

    torch.manual_seed(0)
    x = torch.randn(300, 97, device="cuda")
    pair = split_bf16(x)
    assert torch.equal(pair[:, :97], x.bfloat16())
    assert torch.equal(pair[:, 97:], (x - x.bfloat16().float()).bfloat16())
    B = (torch.randn(4099, 384, device="cuda") * 0.1).to(b_dtype)
    A = torch.randn(384, 256, device="cuda") / 16
    G = A @ A.t()
    assert torch.equal(torch.compile(split_bf16, fullgraph=True)(x), pair)
    eager = bg_bf16x3(B, G)
    compiled = torch.compile(bg_bf16x3, fullgraph=True)(B, G)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_zero_magnitude_columns_recompute_inner(dtype):
    """No bias, no dropout: the fused backward recovers inner from y, except in columns with
    m = 0, where its kernel recomputes x W_iᵀ + s·h B_iᵀ (odd shape; zeros in the first and
    last column and spread over many blocks). Output and every gradient against the spec, and
    dm on the m = 0 columns on their own (enough of them for a stable error estimate)."""
    case = cases.Case(
        "zero_magnitude", d_in=777, d_out=1000, r=24, lead=(300,), alpha=1.7 * 24, bias=False
    )
    d = case.make(0)
    zeros = sorted({0, 3, 640, 999, *range(10, 1000, 37)})
    m = d.m.copy()
    m[zeros] = 0.0
    out = check_tier(case, DTYPES[dtype], "fused", device="cuda", data=dataclasses.replace(d, m=m))
    dm, ref, base = (v[zeros] for v in out["dm"])
    assert np.all(ref != 0)
    assert_close(
        dm,
        ref,
        base,
        machine_eps=torch.finfo(DTYPES[dtype]).eps,
        name=f"{dtype} dm at m = 0 columns",
    )


def test_cuda_recover_pass_finishes_dm_deterministically_across_programs():
    """The last program of each column block adds the partials of every token chunk: with
    256 chunks racing per block, dm is bit-identical over repeated launches (a fixed order)
    and matches float64 (a partial read before it was written would not), the tickets are
    back at zero afterwards, and a CUDA-graph capture (its own zeroed tickets) replays to
    the same bits."""
    import dataclasses

    from dora_torch import config
    from dora_torch.kernels import backward
    from dora_torch.kernels.workspace import ticket_counters

    v = scale_reduce_inputs(8192, 3000, 64, 16, seed=9, device="cuda", dtype=torch.bfloat16)
    x, W, h, B, dy, y, m, n = v.values()
    m[::101] = 0  # blocks whose finishing program also recomputes inner
    cfg = dataclasses.replace(config.BWD, min_programs=10**6)  # block_m tokens per chunk
    args = dict(recover=True, dropout=False, need_dbias=False, x=x, weight=W, h=h,
                lora_B=B, scaling=0.5, reduce_config=cfg)  # fmt: skip
    first = backward.scale_reduce(dy, y, m, n, **args)[2]
    for _ in range(20):
        assert torch.equal(backward.scale_reduce(dy, y, m, n, **args)[2], first)
    torch.cuda.synchronize()
    assert not ticket_counters(dy.device, 1024).any()
    inner = (y.double() / (m / n).double()).where(m != 0, 0.0)
    inner[:, m == 0] = (x.double() @ W.double().t() + 0.5 * h.double() @ B.double().t())[:, m == 0]
    terms = dy.double() * inner
    # fp32 sums of 256 partials: far under 4e-5·Σ|terms|; one chunk (32 tokens) missing or
    # read before it was written is ~100× over it.
    err = (first.double() - terms.sum(0) / n.double()).abs()
    assert (err <= 4e-5 * terms.abs().sum(0) / n.double()).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backward.scale_reduce(dy, y, m, n, **args)[2]
    for _ in range(3):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first)


@pytest.mark.parametrize("dm_dtype", [torch.bfloat16, torch.float16])
def test_cuda_dm_finish_stores_dm_rounded_once_in_the_magnitude_dtype(dm_dtype):
    """The kernel that finishes dm stores it in the magnitude's dtype: bit-equal to the fp32
    dm rounded to nearest-even afterwards (the cast it replaces), zero-magnitude columns (whose
    inner the kernel recomputes) included."""
    from dora_torch.kernels import backward

    v = scale_reduce_inputs(600, 1000, 256, 16, seed=5, device="cuda", dtype=torch.bfloat16)
    x, W, h, B, dy, y, m, n = v.values()
    m[::97] = 0
    args = dict(recover=True, dropout=False, need_dbias=False, x=x, weight=W, h=h,
                lora_B=B, scaling=0.5)  # fmt: skip
    m = m.to(dm_dtype)
    got = backward.scale_reduce(dy, y, m, n, dm_dtype=dm_dtype, **args)[2]
    ref = backward.scale_reduce(dy, y, m, n, **args)[2]
    assert got.dtype == dm_dtype and ref.dtype == torch.float32
    assert torch.equal(got, ref.to(dm_dtype))
