"""Edge cases, argument errors and the pieces behind the tiers (norm, compose kernels)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import dora_torch
import shared_spec as S
from dora_torch import config
from dora_torch.kernels.compose import compose_elementwise, compose_forward
from shared_spec.tolerances import assert_close

from .helpers import dense_baseline, random_case_tensors, scale_reduce_inputs, uncached_output

IMPLS = ["eager", "fused"]


def test_eps_matches_spec():
    assert dora_torch.EPS == S.EPS


@pytest.mark.parametrize("chunk", [None, 7, 1000])
@pytest.mark.parametrize("impl", IMPLS)
def test_factored_norm_matches_dense(impl, chunk):
    _, W, A, B, _, _, s = random_case_tensors(3, d_in=45, d_out=33, r=6)
    n = dora_torch.factored_norm(W, A, B, s, chunk_size=chunk, impl=impl)
    ref = S.dense_norm(W.double().numpy(), A.double().numpy(), B.double().numpy(), s)
    assert n.dtype == torch.float32 and n.shape == (33,)
    np.testing.assert_allclose(n.numpy(), ref, rtol=2e-6)
    base_sq = dora_torch.base_sq_norm(W)
    n2 = dora_torch.factored_norm(W, A, B, s, base_sq=base_sq, impl=impl)
    torch.testing.assert_close(n2, n)


@pytest.mark.parametrize("method", ["kernel", "gemm", "auto"])
# 40 > the interpreter's block: several r-steps; 72 takes the wide-rank blocks (config)
@pytest.mark.parametrize("r", [1, 6, 40, 72])
def test_norm_assembly_methods_match_eager(method, r):
    from dora_torch.kernels.norm import assemble_norm
    from dora_torch.norm import assemble, cross_terms, gram

    _, W, A, B, _, _, s = random_case_tensors(5, d_in=45, d_out=37, r=r)
    base_sq = dora_torch.base_sq_norm(W)
    U, G = cross_terms(W, A), gram(A, W)
    want = assemble(base_sq, U, B, G, s, fused=False)
    got = assemble_norm(base_sq, U, B, G, s, method=method)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    ref = S.dense_norm(W.double().numpy(), A.double().numpy(), B.double().numpy(), s)
    np.testing.assert_allclose(got.numpy(), ref, rtol=2e-6)
    with pytest.raises(ValueError, match="method"):
        assemble_norm(base_sq, U, B, G, s, method="dense")


def test_auto_assembly_uses_the_gemm_only_where_it_keeps_the_accuracy(monkeypatch):
    """An fp32 layer takes the gemm only with IEEE fp32 matmuls; a 16-bit one (bf16x3) always
    takes the gemm's bf16 products, formed by the pairs kernel, unless
    ``config.NORM_GEMM_BF16X3`` is off."""
    from dora_torch import config
    from dora_torch.kernels.norm import assembly_method

    monkeypatch.setattr(config, "NORM_GEMM_MIN_RANK", 32)
    matmul = torch.backends.cuda.matmul  # a flag object: monkeypatch cannot set it
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert (assembly_method(31), assembly_method(32)) == ("kernel", "gemm")
        assert (assembly_method(31, True), assembly_method(32, True)) == ("kernel", "pairs")
        matmul.allow_tf32 = True
        assert assembly_method(384) == "kernel"  # a TF32 cuBLAS GEMM would lose fp32 accuracy
        assert assembly_method(384, True) == "pairs"  # bf16 products: no TF32 involved
        monkeypatch.setattr(config, "NORM_GEMM_BF16X3", False)
        assert assembly_method(384, True) == "kernel"
    finally:
        matmul.allow_tf32 = before


@pytest.mark.parametrize("b_dtype", [torch.float32, torch.bfloat16])
def test_bf16x3_product_error_bound(b_dtype):
    """B·G from bf16 pairs (kernels/norm.py): each entry within 3·2⁻¹⁶ Σ_k |B_ik||G_kj| of
    float64 (2⁻¹⁶ for a bf16 B, which needs no lo term), where the one-product bf16 form,
    B_hi·G_hi, is not."""
    from dora_torch.kernels.norm import bg_bf16x3, split_bf16

    g = torch.Generator().manual_seed(4)
    r = 96
    A = torch.randn(r, 300, generator=g) / 10
    G = A @ A.t()
    B = (torch.randn(500, r, generator=g) * 0.1).to(b_dtype)
    want = B.double() @ G.double()
    scale = B.double().abs() @ G.double().abs()
    P = bg_bf16x3(B, G)
    assert P.shape == (500, 2 * r) and P.dtype == torch.float32
    got = (P[:, :r] + P[:, r:]).double()
    bound = (3 if b_dtype == torch.float32 else 1) * 2.0**-16
    assert ((got - want).abs() / scale).max() <= bound * 1.05  # + fp32 accumulation
    one = split_bf16(B)[:, :r].double() @ split_bf16(G)[:, :r].double()
    assert ((one - want).abs() / scale).max() > 4 * bound
    pair = split_bf16(G).double()
    hi, lo = pair[:, :r], pair[:, r:]
    assert torch.equal(hi, G.bfloat16().double())
    assert torch.equal(lo, (G - G.bfloat16().float()).bfloat16().double())  # rounded once
    assert ((hi + lo - G.double()).abs() <= 2.0**-16 * G.double().abs()).all()
    assert not split_bf16(B.bfloat16())[:, r:].any()  # a bf16 x needs no lo


def test_split_bf16_rounds_like_torch():
    """hi is torch's own round-to-nearest-even bf16 (ties both ways, negatives, a carry into
    the exponent, zeros), lo the rest rounded the same way (the kernel under the interpreter,
    whose own casts truncate; test_gpu.py runs it compiled)."""
    from dora_torch.kernels.norm import split_bf16

    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x3FFFFFFF])
    x = torch.cat([ties.to(torch.int32).view(torch.float32), torch.tensor([0.0, -0.0, 1e30])])
    x = torch.cat([x, torch.randn(292, generator=torch.Generator().manual_seed(0))])
    x = x.view(3, 100)
    pair = split_bf16(x)
    assert torch.equal(pair[:, :100], x.bfloat16())
    assert torch.equal(pair[:, 100:], (x - x.bfloat16().float()).bfloat16())
    assert split_bf16(x[:0]).shape == (0, 200)
    stacked = split_bf16(x, stacked=True)  # [[hi, lo], [hi, 0]]
    assert stacked.shape == (6, 200)
    assert torch.equal(stacked[:3], pair) and torch.equal(stacked[3:, :100], pair[:, :100])
    assert not stacked[3:, 100:].any()


@pytest.mark.parametrize("b_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["gemm", "pairs"])
# r > the interpreter's 16-wide blocks: several j and k steps, masked; the pairs kernel's column
# blocks: 1 (r = 1, 6), 2 (20), 3 (40), 4 (60), 5 (72, where K = 2r = 144 for an fp32 B)
@pytest.mark.parametrize("r", [1, 6, 20, 40, 60, 72])
def test_bf16x3_assemblies_norm_within_their_bound(r, method, b_dtype):
    """The bf16x3 assemblies (a 16-bit layer: the gemm's, and the pairs kernel forming the
    same products in registers from G's blocks on and above its diagonal) against float64:
    the norm moves by at most what the B·G bound allows (each sums both halves)."""
    from dora_torch.kernels.norm import assemble_norm
    from dora_torch.kernels.workspace import ticket_counters
    from dora_torch.norm import cross_terms, gram

    _, W, A, B, _, _, s = random_case_tensors(7, d_in=45, d_out=37, r=r)
    B = (B * 4).to(b_dtype)  # a large s²·B G Bᵀ term, so that its error shows
    base_sq = dora_torch.base_sq_norm(W)
    U, G = cross_terms(W, A), gram(A, W)
    got = assemble_norm(base_sq, U, B, G, s, method=method, bf16x3=True).double()
    Bd, Ud, Gd = B.double(), U.double(), G.double()
    sq = base_sq.double() + (Bd * (2 * s * Ud + s * s * (Bd @ Gd))).sum(1)
    want = sq.sqrt()
    slack = s * s * (Bd.abs() * (Bd.abs() @ Gd.abs())).sum(1) * 3 * 2.0**-16
    assert ((got**2 - sq).abs() <= slack + 1e-6 * sq).all()
    plain = assemble_norm(base_sq, U, B, G, s, method="gemm").double()
    if b_dtype == torch.float32:
        assert not torch.equal(got, plain)  # the split path ran
    np.testing.assert_allclose(plain.numpy(), want.numpy(), rtol=2e-6)
    # the same bf16 products as the gemm's, in another order of fp32 sums
    gemm = assemble_norm(base_sq, U, B, G, s, method="gemm", bf16x3=True).double()
    np.testing.assert_allclose(got.numpy(), gemm.numpy(), rtol=1e-6)
    # the pairs kernel's finishers (r > 16: several column blocks here) leave tickets at zero
    assert not ticket_counters(U.device, 64).any()


def test_pairs_assembly_needs_a_16_bit_layer(monkeypatch):
    """method="pairs" names what it needs; set in config it serves the 16-bit layers and
    leaves an fp32 layer to "auto" (and the one-pass norm at small ranks to fp32 layers)."""
    from dora_torch import config
    from dora_torch.kernels.norm import assemble_norm
    from dora_torch.kernels.norm_pass import norm_pass_applies
    from dora_torch.norm import cross_terms, gram

    _, W, A, B, _, _, s = random_case_tensors(8, d_in=45, d_out=37, r=6)
    base_sq, U, G = dora_torch.base_sq_norm(W), cross_terms(W, A), gram(A, W)
    with pytest.raises(ValueError, match="bf16x3=True"):
        assemble_norm(base_sq, U, B, G, s, method="pairs")
    auto = assemble_norm(base_sq, U, B, G, s, method="auto")
    monkeypatch.setattr(config, "NORM_ASSEMBLY", "pairs")
    assert torch.equal(assemble_norm(base_sq, U, B, G, s), auto)
    pairs = assemble_norm(base_sq, U, B, G, s, bf16x3=True)
    assert torch.equal(pairs, assemble_norm(base_sq, U, B, G, s, method="pairs", bf16x3=True))
    assert norm_pass_applies(W, 6) and not norm_pass_applies(W.bfloat16(), 6)


def test_factored_norm_bf16_accumulates_in_fp32():
    _, W, A, B, _, _, s = random_case_tensors(4, d_in=512, d_out=16, r=8, dtype=torch.bfloat16)
    n = dora_torch.factored_norm(W, A, B, s)
    ref = S.dense_norm(*(t.double().numpy() for t in (W, A, B)), s)
    assert n.dtype == torch.float32
    np.testing.assert_allclose(n.numpy(), ref, rtol=1e-5)


@pytest.mark.parametrize("epilogue", [True, False], ids=["gemm-epilogue", "elementwise"])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_both_compose_kernels_match_eager(epilogue, dropout, bias):
    torch.manual_seed(0)
    T, d_out, r = 37, 45, 5
    dt = torch.bfloat16
    # Small integers: h Bᵀ is exact in bf16 whether the kernel rounds it (cuBLAS path) or not.
    h = torch.randint(-3, 4, (T, r)).to(dt)
    Bw = torch.randint(-3, 4, (d_out, r)).to(dt)
    base_d = torch.randn(T, d_out).to(dt)
    base = torch.randn(T, d_out).to(dt) if dropout else None
    m = torch.rand(d_out) + 0.5
    n = torch.rand(d_out) + 0.5
    bvec = torch.randn(d_out) if bias else None
    lora = (h.float() @ Bw.float().t()).to(dt)
    if dropout:
        want = dora_torch.compose_dropout(base, base_d, lora, m, n, 2.0, bvec)
    else:
        want = dora_torch.compose(base_d, lora, m, n, 2.0, bvec)
    inner_want = (base_d.float() + 2.0 * lora.float()).to(dt)
    y, inner = compose_forward(
        h, Bw, base_d.clone(), m, n, 2.0, bvec, base=base, store_inner=True, epilogue=epilogue
    )
    # One rounding of an fp32 value: at most one bf16 ulp away from the eager result.
    torch.testing.assert_close(y, want, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(inner, inner_want, rtol=2**-7, atol=1e-6)


def test_compose_is_stable_near_unity_g():
    """The naive (g − 1)·base in bf16 loses the magnitude; ours keeps it (docs/design.md §3)."""
    T, d_out = 8, 64
    base = torch.full((T, d_out), 100.0, dtype=torch.bfloat16)
    lora = torch.zeros(T, d_out, dtype=torch.bfloat16)
    n = torch.ones(d_out)
    m = n * (1 + 2**-10)  # g − 1 = 2⁻¹⁰: rounds to 0 in bf16
    y = compose_elementwise(lora, base.clone(), m, n, 1.0)
    want = (100.0 * (1 + 2**-10)) * torch.ones(T, d_out)
    assert torch.equal(y, want.to(torch.bfloat16))
    assert torch.equal(dora_torch.compose(base, lora, m, n, 1.0), y)


@pytest.mark.parametrize(
    "T, d_in, d_out, r, zeros",
    # "blocks": several blocks each way; "r1_t1": one token, rank 1 (below tl.dot's 16);
    # "chunks": 150 tokens, three token chunks under the interpreter, whose partial sums the
    # finishing kernel adds up beside the recomputed columns
    [
        (6, 30, 18, 3, [0, 7, 17]),
        (40, 50, 70, 20, [1, 69]),
        (1, 17, 33, 1, [0, 32]),
        (150, 20, 40, 4, [0, 39]),
    ],
    ids=["small", "blocks", "r1_t1", "chunks"],
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("impl", IMPLS)
def test_zero_magnitude_rows_get_their_gradient(impl, bias, T, d_in, d_out, r, zeros):
    """m_i = 0 ⇒ y_i = b_i, but dm_i ≠ 0. Without bias the fused tier recovers inner from y,
    which is impossible on such rows: the kernel that finishes dm recomputes inner there. In
    the "blocks" case a column block without a zero magnitude sits between two with one."""
    x, W, A, B, m, b, s = random_case_tensors(5, d_in=d_in, d_out=d_out, r=r, lead=(T,))
    m[zeros] = 0.0
    b = b if bias else None
    dy = torch.randn(T, d_out, generator=torch.Generator().manual_seed(1))
    mm = m.clone().requires_grad_(True)
    y = dora_torch.dora_linear(x, W, A, B, mm, s, b, impl=impl)
    y.backward(dy)
    want = S.dora_linear_vjp(
        *(t.double().numpy() for t in (x, W, A, B, m)),
        s,
        dy.double().numpy(),
        None if b is None else b.double().numpy(),
    )
    assert torch.all(mm.grad[zeros] != 0)
    # fp32 sums over T tokens against float64: error relative to the largest entry.
    np.testing.assert_allclose(mm.grad.numpy(), want.dm, rtol=0, atol=2e-6 * np.abs(want.dm).max())


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_rows_stay_finite(impl):
    """W_i = B_i = 0 (n = 0 → clamped) with m_i ≠ 0 and with m_i = 0: finite outputs/grads."""
    x, W, A, B, m, b, s = random_case_tensors(6, d_in=20, d_out=10, r=2, dtype=torch.bfloat16)
    W[[1, 4]] = 0
    B[[1, 4]] = 0
    m[1], m[4] = 0.5, 0.0
    leaves = [t.clone().requires_grad_(True) for t in (x, A, B, m)]
    y = dora_torch.dora_linear(leaves[0], W, leaves[1], leaves[2], leaves[3], s, b, impl=impl)
    y.float().sum().backward()
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[:, [1, 4]], b[[1, 4]].expand(6, 2))
    for t in leaves:
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_and_3d_input(impl):
    x, W, A, B, m, b, s = random_case_tensors(7, d_in=24, d_out=20, r=4, lead=(4, 6))
    xt = x.transpose(0, 1)  # [6, 4, 24], non-contiguous
    assert not xt.is_contiguous()
    y = dora_torch.dora_linear(xt, W, A, B, m, s, b, impl=impl)
    ref = S.dora_linear(*(t.double().numpy() for t in (xt, W, A, B, m)), s, b.double().numpy())
    assert y.shape == (6, 4, 20)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens_and_rank_one(impl):
    x, W, A, B, m, b, s = random_case_tensors(8, d_in=17, d_out=9, r=1, lead=(0,))
    leaves = [t.clone().requires_grad_(True) for t in (x, A, B, m)]
    y = dora_torch.dora_linear(leaves[0], W, *leaves[1:3], leaves[3], s, b, impl=impl)
    assert y.shape == (0, 9)
    y.sum().backward()
    assert leaves[0].grad.shape == (0, 17)
    assert torch.count_nonzero(leaves[3].grad) == 0 and torch.count_nonzero(leaves[1].grad) == 0


def test_inference_saves_nothing_and_matches_training_forward():
    x, W, A, B, m, b, s = random_case_tensors(9)
    with torch.no_grad():
        y0 = dora_torch.dora_linear(x, W, A, B, m, s, b, impl="fused")
    y1 = dora_torch.dora_linear(x, W, A, B.requires_grad_(True), m, s, b, impl="fused")
    assert not y0.requires_grad and y1.requires_grad
    torch.testing.assert_close(y0, y1.detach(), rtol=0, atol=0)


def test_dispatch_rule_and_override():
    x, W, A, B, m, b, s = random_case_tensors(10)
    assert dora_torch.resolve_impl("auto", x, 20) == "eager"  # CPU → eager
    assert dora_torch.resolve_impl("fused", x, 20) == "fused"  # interpreter (conftest)
    with pytest.raises(TypeError, match="impl='fused'"):
        dora_torch.resolve_impl("fused", x.double(), 20)
    with pytest.raises(ValueError, match="impl must be one of"):
        dora_torch.dora_linear(x, W, A, B, m, s, b, impl="triton")


def test_fused_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(config, "_INTERPRETING", False)  # as if imported without the interpreter
    x, W, A, B, m, b, s = random_case_tensors(11)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        dora_torch.dora_linear(x, W, A, B, m, s, b, impl="fused")
    assert config.interpreting() is False


def test_epilogue_gemm_tile_rule(monkeypatch):
    """The square tile only where the H200 sweeps had it win: a rank from
    LORA_GEMM_SQUARE_MIN_RANK, enough tiles, no stored inner and no dropout; the narrow one
    for a stored inner or dropout, small ranks and few tiles."""
    monkeypatch.setattr(config, "_INTERPRETING", False)
    square, narrow = config.LORA_GEMM_SQUARE, config.LORA_GEMM_NARROW
    assert (square.block_m, square.block_n, square.num_warps) == (128, 128, 4)
    assert square != narrow
    big_r = config.LORA_GEMM_SQUARE_MIN_RANK
    assert config.lora_gemm_config(2048, 4096, big_r) == square  # 512 tiles
    assert config.lora_gemm_config(2048, 4096, big_r - 1) == narrow
    assert config.lora_gemm_config(2048, 4096, big_r, store_inner=True) == narrow
    assert config.lora_gemm_config(2048, 4096, big_r, dropout=True) == narrow
    assert config.lora_gemm_config(2048, 1024, big_r) == narrow  # 128 tiles
    assert config.lora_gemm_config(8192, 1024, big_r) == square  # 512 tiles


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"x": torch.randn(6, 23)}, ValueError, "x must have shape"),
        ({"x": torch.randn(6, 24, dtype=torch.float64)}, TypeError, "x has dtype"),
        ({"x": torch.randint(0, 3, (6, 24))}, TypeError, "x must be a floating-point"),
        ({"W": torch.randn(20)}, ValueError, "weight must be 2-D"),
        ({"A": torch.randn(4, 23)}, ValueError, "lora_A must have shape"),
        ({"B": torch.randn(20, 5)}, ValueError, "lora_B must have shape"),
        ({"B": torch.randn(4, 20)}, ValueError, "lora_B must have shape"),
        ({"m": torch.randn(19)}, ValueError, "magnitude must have shape"),
        ({"b": torch.randn(21)}, ValueError, "bias must have shape"),
        ({"A": [[1.0]]}, TypeError, "lora_A must be a torch.Tensor"),
        ({"s": torch.tensor(2.0)}, TypeError, "scaling must be a Python number"),
        ({"s": float("nan")}, ValueError, "scaling must be finite"),
        ({"A": torch.randn(4, 24, device="meta")}, ValueError, "lora_A is on meta"),
    ],
)
def test_bad_arguments_name_the_argument(change, exc, match):
    x, W, A, B, m, b, s = random_case_tensors(12)
    args = {"x": x, "W": W, "A": A, "B": B, "m": m, "b": b, "s": s} | change
    with pytest.raises(exc, match=match):
        dora_torch.dora_linear(
            args["x"], args["W"], args["A"], args["B"], args["m"], args["s"], args["b"]
        )


def test_bad_norm_arguments():
    x, W, A, B, m, _, s = random_case_tensors(13)
    with pytest.raises(ValueError, match="chunk_size"):
        dora_torch.factored_norm(W, A, B, s, chunk_size=0)
    with pytest.raises(ValueError, match="base_sq"):
        dora_torch.factored_norm(W, A, B, s, base_sq=torch.ones(3))
    with pytest.raises(ValueError, match="dropout_p"):
        dora_torch.dora_linear(x, W, A, B, m, s, dropout_p=1.0, training=True)
    with pytest.raises(ValueError, match="norm must be fp32"):
        dora_torch.dora_linear(x, W, A, B, m, s, norm=torch.ones(20, dtype=torch.float64))


def test_fp32_adapters_with_bf16_activations():
    """Adapter dtype policy: fp32 A, B, m with bf16 x, W; grads come back in fp32. Output and
    every gradient against the spec (on the values given: bf16 x, W, bias; fp32 adapters) by
    the shared rule; baseline: plain dense DoRA in bf16 with the adapters cast to bf16."""
    x, W, A, B, m, b, s = random_case_tensors(14, d_in=32, d_out=24, r=4)
    xb, Wb, bb = x.bfloat16(), W.bfloat16(), b.bfloat16()
    dy = torch.randn(6, 24, generator=torch.Generator().manual_seed(2)).bfloat16()
    eps = torch.finfo(torch.bfloat16).eps

    def f64(t):
        return t.detach().double().numpy()

    spec_in = (*(f64(t) for t in (xb, Wb, A, B, m)), s)
    ref = {"y": S.dora_linear(*spec_in, f64(bb))}
    g = S.dora_linear_vjp(*spec_in, f64(dy), f64(bb))
    ref |= {"dx": g.dx, "dA": g.dA, "dB": g.dB, "dm": g.dm}

    def run(fn, adapters):
        leaves = [t.detach().clone().requires_grad_(True) for t in (xb, *adapters)]
        y = fn(*leaves)
        y.backward(dy)
        return y, {"y": y, **{f"d{n}": t.grad for n, t in zip("xABm", leaves)}}

    def baseline(x, A, B, m):
        return dense_baseline(x, Wb, A, B, m, s, bb)

    _, base = run(baseline, [t.bfloat16() for t in (A, B, m)])
    for impl in IMPLS:

        def ours(x, A, B, m, impl=impl):
            return dora_torch.dora_linear(x, Wb, A, B, m, s, bb, impl=impl)

        y, got = run(ours, (A, B, m))
        assert y.dtype == torch.bfloat16 and got["dx"].dtype == torch.bfloat16
        assert all(got[k].dtype == torch.float32 for k in ("dA", "dB", "dm"))
        for q, want in ref.items():
            assert_close(f64(got[q]), want, f64(base[q]), machine_eps=eps, name=f"{impl} {q}")


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_magnitude_and_bias(impl):
    """Per-column vectors that are views with stride ≠ 1 (e.g. a column of a matrix)."""
    x, W, A, B, m, b, s = random_case_tensors(21)
    m_strided = torch.stack([m, torch.zeros_like(m)], dim=1)[:, 0]  # stride 2
    b_strided = torch.stack([b, torch.ones_like(b)], dim=1)[:, 0]
    assert m_strided.stride() == (2,) and b_strided.stride() == (2,)
    leaves = [t.clone().requires_grad_(True) for t in (x, A, B)]
    m_leaf = m_strided.detach().requires_grad_(False)
    y = dora_torch.dora_linear(leaves[0], W, *leaves[1:3], m_leaf, s, b_strided, impl=impl)
    ref = S.dora_linear(*(t.double().numpy() for t in (x, W, A, B, m)), s, b.double().numpy())
    np.testing.assert_allclose(y.detach().numpy(), ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    g = S.dora_linear_vjp(
        *(t.double().numpy() for t in (x, W, A, B, m)), s, dy.double().numpy(), b.double().numpy()
    )
    np.testing.assert_allclose(leaves[0].grad.numpy(), g.dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(leaves[2].grad.numpy(), g.dB, rtol=1e-4, atol=1e-5)


def test_inference_mode_then_training_step():
    """Validation under torch.inference_mode() between training steps must not poison the
    cached norm (an inference tensor cannot be saved for backward)."""
    layer = dora_torch.Linear(24, 20, r=4, lora_alpha=8)
    x = torch.randn(6, 24)
    with torch.inference_mode():
        layer(x)
    layer(x).square().sum().backward()  # reuses the cached norm: must not raise
    assert layer.lora_B.grad is not None and torch.isfinite(layer.lora_B.grad).all()


def test_autocast_runs_the_layer_in_the_autocast_dtype():
    layer = dora_torch.Linear(24, 20, r=4, lora_alpha=8)  # fp32 weights, like HF Trainer bf16
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    x = torch.randn(6, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.lora_A.grad.dtype == torch.float32
    # Same numbers as running the layer on bf16 inputs and weight explicitly.
    ref = dora_torch.dora_linear(
        x.detach().bfloat16(),
        layer.weight.bfloat16(),
        layer.lora_A,
        layer.lora_B,
        layer.lora_magnitude_vector,
        layer.scaling,
        layer.bias.bfloat16(),
        norm=layer.norm(impl="eager"),  # the layer's cached fp32-weight norm
    )
    torch.testing.assert_close(y.detach(), ref.detach(), rtol=0, atol=0)


def test_the_cached_norm_does_not_depend_on_the_callers_autocast():
    """The cache key holds the tensors, not the caller's context: a norm first computed inside
    an autocast forward (HF Trainer's bf16 mode, fp32 weights) must be the fp32-weight norm
    of the precision rule, not one from bf16 GEMMs."""
    torch.manual_seed(0)
    layer = dora_torch.Linear(64, 48, r=4, lora_alpha=8)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(6, 64))
    inside = layer.norm(impl="eager").clone()
    dora_torch.clear_caches(layer)
    assert torch.equal(inside, layer.norm(impl="eager"))


@pytest.mark.parametrize("lead", [(6,), (2, 3)])
def test_in_place_edit_of_a_recovered_output_is_refused(lead):
    """Fused, no bias, bf16: backward recovers inner from y (ops.SAVE_RECOVER), so editing y in
    place before backward must raise autograd's error, never give silently wrong gradients
    (also when y is reshaped back to x's leading dims)."""
    x, W, A, B, m, _, s = random_case_tensors(22, dtype=torch.bfloat16, lead=lead)
    B = B.clone().requires_grad_(True)
    y = dora_torch.dora_linear(x, W, A, B, m, s, None, impl="fused")
    y.relu_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_clear_caches_after_writes_that_bypass_versions():
    layer = dora_torch.Linear(24, 20, r=4, lora_alpha=8)
    model = torch.nn.Sequential(layer)
    x = torch.randn(5, 24)
    with torch.no_grad():
        layer(x)
        layer.lora_B.data.copy_(torch.randn_like(layer.lora_B) * 0.5)  # version unchanged
        stale = layer(x)
        assert dora_torch.clear_caches(model) == 1
        fresh = layer(x)
    ref = uncached_output(layer, x)
    torch.testing.assert_close(fresh, ref)
    assert not torch.allclose(stale, ref)


def test_fused_refuses_tensors_beyond_int32_offsets(monkeypatch):
    from dora_torch.kernels import common

    x, W, A, B, m, b, s = random_case_tensors(23)  # y is [6, 20]: spans 120 elements
    assert common.element_span(x.t()) == x.numel()
    assert common.element_span(x[:, :0]) == 0
    monkeypatch.setattr(common, "MAX_KERNEL_SPAN", 100)
    with pytest.raises(ValueError, match="int32 offsets"):
        dora_torch.dora_linear(x, W, A, B, m, s, b, impl="fused")
    dora_torch.dora_linear(x, W, A, B, m, s, b, impl="eager")  # the eager tier has no limit


def test_the_span_of_a_view_is_bounded_by_its_storage_then_counted(monkeypatch):
    """check_launchable settles a column view by its storage's size and counts the span only
    when that bound is over the limit (stacked products' h and base are column views)."""
    from dora_torch.kernels import common

    monkeypatch.setattr(common, "MAX_KERNEL_SPAN", 100)
    common.check_launchable(torch.empty(9, 11)[:, :5])  # storage 99: under, no count
    common.check_launchable(torch.empty(100, 10)[:2, :3])  # storage 1000, span 13
    with pytest.raises(ValueError, match="spans 113 elements"):
        common.check_launchable(torch.empty(10, 12)[:, :5])


def _record_grids(monkeypatch, module, launcher: str) -> list:
    """The grids ``module.<launcher>`` is called with from now on (it still launches)."""
    grids, launch = [], getattr(module, launcher)

    def record(grid, *args, **kwargs):
        grids.append(grid)
        launch(grid, *args, **kwargs)

    monkeypatch.setattr(module, launcher, record)
    return grids


# 16 and 32: one r-block; 17: padded; d_in 45 and d_out 37: ragged last tiles (interpreter
# blocks are 16 wide).
@pytest.mark.parametrize("r", [1, 4, 16, 17, 32])
@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_pass_norm_kernel(r, cached, dtype, monkeypatch):
    """kernels/norm_pass.py against float64 (A rounded to W's dtype, as the precision rule
    says), no worse than 2× the eager tier's error; ‖W‖² from the cache or from its own pass;
    a zero row of W and B gives n = 0; one program per row block; the same bits on a second
    call."""
    from dora_torch.kernels import norm_pass as kernel
    from dora_torch.norm import detached_norm, rounded_a

    grids = _record_grids(monkeypatch, kernel, "_launch_norm_pass")

    _, W, A, B, _, _, s = random_case_tensors(9, d_in=45, d_out=37, r=r)
    W = W.to(dtype)
    with torch.no_grad():
        W[3] = 0
        B[3] = 0
    assert kernel.norm_pass_applies(W, r)
    a = rounded_a(A, W)
    base_sq = dora_torch.base_sq_norm(W) if cached else None
    got = kernel.norm_pass(W, a, B, base_sq, s)
    assert grids == [(3,)]  # row blocks of 16, each over all of d_in
    assert torch.equal(kernel.norm_pass(W, a, B, base_sq, s), got)
    ref = S.dense_norm(W.double().numpy(), a.double().numpy(), B.double().numpy(), s)
    eager = detached_norm(W, A, B, dora_torch.base_sq_norm(W), s, False)
    assert got.dtype == torch.float32 and got.shape == (37,)
    assert got[3] == 0
    err = np.abs(got.double().numpy() - ref).max()
    eager_err = np.abs(eager.double().numpy() - ref).max()
    assert err <= 2 * eager_err + 4 * np.finfo(np.float32).eps * np.abs(ref).max()
    # factored_norm (fused, no cache) takes this kernel; the cached tier feeds it ‖W‖².
    torch.testing.assert_close(dora_torch.factored_norm(W, A, B, s, impl="fused"), got)


def test_one_pass_norm_of_an_empty_d_in_is_the_cached_norm():
    """d_in = 0: W has no columns, so n = sqrt(‖W‖²) as given (0 when computed), never the
    uninitialized output of a grid with no programs."""
    from dora_torch.kernels import norm_pass as kernel

    W, a, B = torch.zeros(37, 0), torch.zeros(4, 0), torch.randn(37, 4)
    assert torch.equal(kernel.norm_pass(W, a, B, None, 2.0), torch.zeros(37))
    base_sq = torch.full((37,), 4.0)
    assert torch.equal(kernel.norm_pass(W, a, B, base_sq, 2.0), torch.full((37,), 2.0))


def test_one_pass_norm_kernel_is_not_used_where_it_does_not_apply(monkeypatch):
    from dora_torch.kernels.norm_pass import norm_pass_applies

    W = torch.zeros(8, 16)
    assert norm_pass_applies(W, 4)
    monkeypatch.setattr(config, "NORM_PASS_MAX_RANK", 0)  # off
    assert not norm_pass_applies(W, 4)
    monkeypatch.setattr(config, "NORM_PASS_MAX_RANK", 32)
    assert not norm_pass_applies(W, config.NORM_PASS_MAX_RANK + 1)
    assert not norm_pass_applies(W.double(), 4)
    monkeypatch.setattr(config, "NORM_ASSEMBLY", "gemm")
    assert not norm_pass_applies(W, 4)


@pytest.mark.parametrize(
    "min_programs, chunks",
    # 64 tokens per program under the interpreter: 4 chunks of 200 tokens; asking for 20
    # programs over 2 column blocks shrinks them to 16 tokens (block_m): 13 chunks.
    [(0, 4), (20, 13)],
)
def test_scale_reduce_token_chunks(monkeypatch, min_programs, chunks):
    """The backward pass over dy reduces tokens in chunks of ``rows_per_program``, fewer when
    the config asks for a minimum number of programs, and the partial sums add up:
    dm = Σ_t dy ⊙ inner / n and dbias = Σ_t dy against float64, dy_g = (m / n) ⊙ dy exact to
    rounding."""
    from dora_torch import config
    from dora_torch.kernels import backward

    grids = _record_grids(monkeypatch, backward, "_launch_scale_reduce")
    g = torch.Generator().manual_seed(3)
    dy, inner = torch.randn(200, 40, generator=g), torch.randn(200, 40, generator=g)
    m, n = torch.rand(40, generator=g) + 0.5, torch.rand(40, generator=g) + 0.5
    cfg = dataclasses.replace(config.BWD, min_programs=min_programs)
    dyg, _, dm, dbias = backward.scale_reduce(
        dy, inner, m, n, recover=False, dropout=False, need_dbias=True, reduce_config=cfg
    )
    assert grids == [(chunks, 2)]  # token chunks × column blocks of 32
    terms, n64 = dy.double() * inner.double(), n.double()
    eps = torch.finfo(torch.float32).eps
    # fp32 summation over 200 tokens: |error| ≤ 200·eps·Σ|terms| (a loose, order-free bound)
    dm_err = (dm.double() - terms.sum(0) / n64).abs()
    assert (dm_err <= 200 * eps * terms.abs().sum(0) / n64).all()
    db_err = (dbias.double() - dy.double().sum(0)).abs()
    assert (db_err <= 200 * eps * dy.double().abs().sum(0)).all()
    torch.testing.assert_close(dyg, (m / n) * dy)


@pytest.mark.parametrize("recover", [False, True])
@pytest.mark.parametrize("dm_dtype", [torch.bfloat16, torch.float16])
def test_scale_reduce_returns_dm_in_the_magnitude_dtype(recover, dm_dtype):
    """dm comes back in the dtype asked for (the magnitude's), the fp32 sum rounded once:
    bit-equal to the fp32 dm cast afterwards, on the path that finishes dm in a kernel
    (recover) and on the one that sums partials (saved inner). Under the interpreter the
    finishing kernel stores fp32 and the host casts; the kernel's own rounding is pinned by
    test_gpu.py::test_cuda_dm_finish_stores_dm_rounded_once_in_the_magnitude_dtype."""
    from dora_torch.kernels import backward

    x, W, h, B, dy, saved, m, n = scale_reduce_inputs(150, 40, 24, 4, seed=5).values()
    m[3] = 0  # recover mode recomputes inner for this column in the finishing kernel
    kw = dict(recover=recover, dropout=False, need_dbias=False, x=x, weight=W, h=h,
              lora_B=B, scaling=0.5)  # fmt: skip
    ref = backward.scale_reduce(dy, saved, m, n, **kw)[2]
    got = backward.scale_reduce(dy, saved, m, n, dm_dtype=dm_dtype, **kw)[2]
    assert ref.dtype == torch.float32 and got.dtype == dm_dtype
    assert torch.equal(got, ref.to(dm_dtype))


def test_scale_reduce_recover_finishes_dm_in_its_one_launch(monkeypatch):
    """In recover mode the pass finishes dm itself: one launch over (token chunks × column
    blocks), whose last program per column block adds the partials up (the interpreter runs
    programs in order; test_gpu.py races them). Its ticket counters come from one buffer per
    device and stream, left at zero by every launch, and reused by the next."""
    from dora_torch.kernels import backward
    from dora_torch.kernels.workspace import ticket_counters

    grids = _record_grids(monkeypatch, backward, "_launch_scale_reduce")
    x, W, h, B, dy, y, m, n = scale_reduce_inputs(200, 40, 24, 4, seed=11).values()
    kw = dict(recover=True, dropout=False, need_dbias=False, x=x, weight=W, h=h, lora_B=B)
    dm = backward.scale_reduce(dy, y, m, n, **kw)[2]
    assert grids == [(4, 2)]  # 64-token chunks × 32-column blocks under the interpreter
    tickets = ticket_counters(dy.device, 2)
    assert not tickets.any()
    ref = ((dy.double() * y.double() * (n / m).double()).sum(0) / n.double()).float()
    torch.testing.assert_close(dm, ref, rtol=1e-5, atol=1e-5)
    again = backward.scale_reduce(dy, y, m, n, **kw)[2]
    assert torch.equal(again, dm) and ticket_counters(dy.device, 2) is tickets


def test_scale_reduce_recover_refuses_a_bias_gradient():
    """Recovering inner from y is for layers without a bias: asking for dbias there is an
    error naming the argument, not a silent None."""
    from dora_torch.kernels import backward

    dy = torch.randn(4, 8)
    m = n = torch.ones(8)
    with pytest.raises(ValueError, match="need_dbias"):
        backward.scale_reduce(
            dy, dy, m, n, recover=True, dropout=False, need_dbias=True,
            x=dy, weight=dy, h=dy, lora_B=dy,
        )  # fmt: skip


@pytest.mark.parametrize(
    "M, col_blocks, min_programs, rows",
    [
        (2048, 8, 528, 16),  # d_out 1024: 66 parts wanted; 32 tokens would give 64
        (2048, 32, 528, 112),  # d_out 4096: 17 parts wanted; 128 tokens would give 16
        (2048, 112, 528, 496),  # d_out 14336: 5 parts; the caller's own cap (256) applies
        (2048, 600, 528, 2048),  # enough column blocks: one part
        (100, 1, 10_000, 16),  # never below block_m
    ],
)
def test_rows_for_programs(M, col_blocks, min_programs, rows):
    """The grid cdiv(M, rows) × col_blocks reaches min_programs with the most rows per
    program that are a multiple of block_m (16 here), or block_m when nothing does."""
    from dora_torch.kernels.backward import rows_for_programs

    got = rows_for_programs(M, col_blocks, 16, min_programs)
    assert got == rows
    assert got % 16 == 0 and got >= 16
    if got > 16:
        assert -(-M // got) * col_blocks >= min_programs
        assert got >= M or -(-M // (got + 16)) * col_blocks < min_programs
