"""ScaLoRA in PyTorch (dora_torch/scalora.py) against the float64 spec (shared_spec/scalora.py):
closed form and branch, merge, output invariance (plain LoRA, PEFT LoRA/DoRA on a tiny Llama,
dora_torch.Linear), gradient rescaling, AdamW state transfer and the next step, the interval,
the exact DoRA ‖W‖² update, fp32 master weights, and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import dora_torch
import shared_spec as S
from dora_torch import scalora as SC
from dora_torch.scalora import ScaLoRA

F64 = torch.float64
LR_L = 0.7  # lr_times_L in project units


class LoRA(nn.Module):
    """A plain LoRA layer exposing the ``lora_factors()`` protocol."""

    def __init__(self, W, A, B, s):
        super().__init__()
        self.weight = nn.Parameter(torch.as_tensor(W).clone(), requires_grad=False)
        self.lora_A = nn.Parameter(torch.as_tensor(A).clone())
        self.lora_B = nn.Parameter(torch.as_tensor(B).clone())
        self.s = s

    def lora_factors(self):
        return self.weight, self.lora_A, self.lora_B, self.s

    def forward(self, x):
        return x @ self.weight.T + self.s * (x @ self.lora_A.T) @ self.lora_B.T

    def w_eff(self):
        return self.weight + self.s * self.lora_B @ self.lora_A


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


def _data(seed, d_out, d_in, r):
    """(W, A, B, s, G) in float64 numpy; G the full gradient at W_eff (rank 1 every 3rd seed)."""
    rng = np.random.default_rng(seed)
    s = float(rng.uniform(0.5, 2.0))
    W = rng.standard_normal((d_out, d_in))
    A, B = rng.standard_normal((r, d_in)), rng.standard_normal((d_out, r))
    if seed % 3:
        G = rng.standard_normal((d_out, d_in))
    else:
        G = np.outer(rng.standard_normal(d_out), rng.standard_normal(d_in))
    return W, A, B, s, G


def _grads(A, B, s, G):
    return s * B.T @ G, s * G @ A.T  # autograd's ∇lora_A, ∇lora_B for loss ⟨G, W_eff⟩


def _layer(seed, d_out, d_in, r, dtype=F64):
    W, A, B, s, G = _data(seed, d_out, d_in, r)
    m = LoRA(*(torch.tensor(t, dtype=dtype) for t in (W, A, B)), s)
    gA, gB = _grads(A, B, s, G)
    m.lora_A.grad = torch.tensor(gA, dtype=dtype)
    m.lora_B.grad = torch.tensor(gB, dtype=dtype)
    return m, G


def _spec(m):
    """The spec's step on the layer's current (cast to float64) tensors and gradients."""
    n = lambda t: t.detach().double().numpy()  # noqa: E731
    return S.scalora_step_torch(
        n(m.weight), n(m.lora_A), n(m.lora_B), n(m.lora_A.grad), n(m.lora_B.grad), m.s, LR_L
    )


def _seeds(branch, count, shapes):
    """Seeds whose spec step takes ``branch`` (nonsingular K: d_out, d_in > 2r)."""
    out = []
    for seed in range(500):
        d_out, d_in, r = shapes[seed % len(shapes)]
        m, _ = _layer(seed, d_out, d_in, r)
        if _spec(m)[3].branch == branch:
            out.append((seed, d_out, d_in, r))
        if len(out) == count:
            return out
    raise AssertionError(f"no {branch} cases")


R1 = [(7, 9, 1), (11, 7, 1)]
SHAPES = [(7, 9, 1), (6, 8, 2), (9, 5, 2), (8, 10, 3), (11, 7, 1)]
CASES = _seeds("column", 4, SHAPES) + _seeds("scalar", 5, SHAPES) + _seeds("column", 1, R1)


def _close(got, want, tol):
    got = got.detach().double().numpy() if isinstance(got, torch.Tensor) else got
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(got - want).max() <= tol * scale, np.abs(got - want).max() / scale


# ---- closed form, branch and merge vs the spec --------------------------------------------


def test_matches_spec_float64_all_layers_batched():
    layers = [_layer(*c)[0] for c in CASES]
    model = Stack(layers)
    refs = [_spec(m) for m in layers]
    assert {ref[3].branch for ref in refs} == {"column", "scalar"}
    assert any(m.lora_A.shape[0] == 1 for m in layers)
    rep = ScaLoRA(model, None, lr_times_L=LR_L).step()
    branches = rep.branches()
    assert rep.merged and len(rep.names) == len(layers) and rep.skipped == ()
    for k, (m, (Wn, An, Bn, res)) in enumerate(zip(layers, refs)):
        name = f"layers.{k}"
        i = rep.names.index(name)  # the report lists layers grouped by rank
        got = branches[name]
        want = res.branch + (f"/{res.scalar_case}" if res.branch == "scalar" else "")
        assert got == want
        _close(rep.alpha[i], res.alpha, 1e-10)
        _close(rep.beta[i], res.beta, 1e-10)
        _close(m.weight, Wn, 1e-10)
        _close(m.lora_A, An, 1e-10)
        _close(m.lora_B, Bn, 1e-10)
    counts = rep.counts()
    assert counts["column"] == 5 and counts["scalar"] == 5 and sum(counts.values()) == 10
    assert rep.lr_times_L.dtype == F64
    torch.testing.assert_close(
        rep.lr_times_L, torch.tensor([layers[int(n[7:])].s * LR_L for n in rep.names], dtype=F64)
    )


def test_rank_one_is_always_the_column_branch():
    # r = 1: v₁ ∝ ‖Gb‖²(‖b‖²‖Gᵀa‖² − (aᵀGb)²) ≥ 0 (Cauchy–Schwarz), and likewise v₂.
    model = Stack([_layer(seed, *R1[seed % 2])[0] for seed in range(12)])
    rep = ScaLoRA(model, None, lr_times_L=LR_L).step()
    assert rep.counts()["column"] == 12


def test_layer_order_in_report_follows_the_groups():
    model = Stack([_layer(*c)[0] for c in CASES[:4]])
    rep = ScaLoRA(model, None, lr_times_L=LR_L).step()
    assert sorted(rep.names) == sorted(f"layers.{i}" for i in range(4))
    for name, a in zip(rep.names, rep.alpha):
        assert a.shape == (dict(model.named_modules())[name].lora_A.shape[0],)


def _paper_examples():
    """The spec tests' Theorem 3 examples (paper layout A, B, G), one per case."""
    rng = np.random.default_rng(0)
    A = np.array([[0.0, 0.0], [-1.0, -1.0], [-1.0, 0.0]])
    B = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])
    G = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, -1.0, 1.0]])
    a, b = np.array([[1.0], [2.0], [0.0]]), np.array([[0.5], [-1.0]])
    return {
        "a_only": (A, B, G),
        "b_only": (B, A, G.T),
        "both": (rng.standard_normal((5, 2)), rng.standard_normal((4, 2)),
                 rng.standard_normal((5, 4))),
        "degenerate": (np.zeros((4, 2)), rng.standard_normal((3, 2)), rng.standard_normal((4, 3))),
        "degenerate_parallel": (a, b, 3.0 * a @ b.T),
    }  # fmt: skip


def _from_paper(A, B, G, s=1.0):
    """A project-layout layer whose paper-layout factors are (A, B) and full gradient G."""
    c = math.sqrt(s)
    W = np.random.default_rng(1).standard_normal((A.shape[0], B.shape[0]))
    m = LoRA(torch.tensor(W), torch.tensor(B.T / c), torch.tensor(A / c), s)
    gA, gB = _grads(B.T / c, A / c, s, G)
    m.lora_A.grad, m.lora_B.grad = torch.tensor(gA), torch.tensor(gB)
    return m


@pytest.mark.parametrize("case", ["a_only", "b_only"])
def test_hybrid_scalar_cases_match_the_spec(case):
    m = _from_paper(*_paper_examples()[case], s=1.3)
    Wn, An, Bn, res = _spec(m)
    assert res.branch == "scalar" and res.scalar_case == case
    rep = ScaLoRA(m, None, lr_times_L=LR_L).step()
    assert rep.branches()["LoRA"] == f"scalar/{case}"
    _close(rep.alpha[0], res.alpha, 1e-12)
    _close(rep.beta[0], res.beta, 1e-12)
    _close(m.weight, Wn, 1e-12)
    _close(m.lora_A, An, 1e-12)
    _close(m.lora_B, Bn, 1e-12)


@pytest.mark.parametrize("case", list(_paper_examples()))
def test_scalar_formulas_every_case(monkeypatch, case):
    # Force the fallback (a negative v) to check Theorem 3's batched formulas case by case.
    monkeypatch.setattr(SC, "_solve", lambda K, lam: -torch.ones_like(lam))
    A, B, G = _paper_examples()[case]
    s = 1.3
    m = _from_paper(A, B, G, s)
    gA, gB = S.grads_to_paper_layout(m.lora_A.grad.numpy(), m.lora_B.grad.numpy(), s)
    PA, PB = S.to_paper_layout(m.lora_A.detach().numpy(), m.lora_B.detach().numpy(), s)
    a, b, want = S.scalar_scaling(PA, PB, gA, gB, s * LR_L)
    rep = ScaLoRA(m, None, lr_times_L=LR_L).step()
    assert rep.branches()["LoRA"] == f"scalar/{want}"
    _close(rep.alpha[0], np.full(A.shape[1], a), 1e-12)
    _close(rep.beta[0], np.full(A.shape[1], b), 1e-12)


def test_singular_K_gives_an_equally_optimal_solution():
    # M's two terms parallel: K is singular (not through zero columns). The spec returns the
    # minimum-norm solution of K v = λ; we may return another solution, with the same bound.
    A, B, G = _paper_examples()["degenerate_parallel"]
    m = _from_paper(A, B, G)
    res = _spec(m)[3]
    rep = ScaLoRA(m, None, lr_times_L=LR_L).step()
    assert rep.branches()["LoRA"] == res.branch == "column"
    gA, gB = G @ B, G.T @ A
    bound = lambda al, be: S.scaling_bound(al, be, A, B, gA, gB, 1.0, LR_L)  # noqa: E731
    got = bound(rep.alpha[0].numpy(), rep.beta[0].numpy())
    assert got == pytest.approx(bound(res.alpha, res.beta), rel=1e-10)
    K, lam = S.column_system(A, B, gA, gB)
    w = LR_L * np.concatenate([rep.alpha[0].numpy(), rep.beta[0].numpy()]) ** 2
    np.testing.assert_allclose(K @ w, lam, rtol=1e-10)


def test_fp32_layer_matches_spec_to_fp32_tolerance():
    for seed, d_out, d_in, r in CASES:
        m, _ = _layer(seed, d_out, d_in, r, dtype=torch.float32)
        Wn, An, Bn, res = _spec(m)  # the spec on the same fp32 values
        rep = ScaLoRA(m, None, lr_times_L=LR_L).step()
        # The system is formed and solved in float64 from the fp32 values: α, β as in float64.
        _close(rep.alpha[0], res.alpha, 1e-9)
        _close(rep.beta[0], res.beta, 1e-9)
        _close(m.weight, Wn, 2e-6)
        _close(m.lora_A, An, 2e-6)
        _close(m.lora_B, Bn, 2e-6)


def test_auto_lr_times_L_keeps_the_step_length():
    for seed, d_out, d_in, r in CASES:
        m, G = _layer(seed, d_out, d_in, r)
        A0, B0 = S.to_paper_layout(m.lora_A.detach().numpy(), m.lora_B.detach().numpy(), m.s)
        rep = ScaLoRA(m, None).step()  # lr_times_L=None: auto
        eL = float(rep.lr_times_L[0])  # paper units: s·L·η
        m2, _ = _layer(seed, d_out, d_in, r)
        n = lambda t: t.detach().numpy()  # noqa: E731
        res = S.scalora_step_torch(
            n(m2.weight), n(m2.lora_A), n(m2.lora_B), n(m2.lora_A.grad), n(m2.lora_B.grad),
            m2.s, eL / m2.s,
        )[3]  # fmt: skip
        _close(rep.alpha[0], res.alpha, 1e-10)
        _close(rep.beta[0], res.beta, 1e-10)
        # ‖M(w*)‖ = ‖M(1)‖ with M = ÃÃᵀG + GB̃B̃ᵀ, from the full G.
        A1, B1 = A0 * res.alpha, B0 * res.beta
        M0 = A0 @ A0.T @ G + G @ B0 @ B0.T
        M1 = A1 @ A1.T @ G + G @ B1 @ B1.T
        assert np.linalg.norm(M1) == pytest.approx(np.linalg.norm(M0), rel=1e-10)
        # ... and a first-order decrease at least as large (the direction is the best one).
        assert np.sum(G * M1) >= np.sum(G * M0) * (1 - 1e-10)


# ---- the function is unchanged ------------------------------------------------------------


def test_plain_lora_output_unchanged_and_gradients_rescaled():
    for seed, d_out, d_in, r in CASES:
        W, A, B, s, _ = _data(seed, d_out, d_in, r)
        m = LoRA(*(torch.tensor(t) for t in (W, A, B)), s)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(5, d_in, dtype=F64, generator=g)
        dy = torch.randn(5, d_out, dtype=F64, generator=g)
        y0 = m(x)
        (y0 * dy).sum().backward()
        gA0, gB0 = m.lora_A.grad.clone(), m.lora_B.grad.clone()
        rep = ScaLoRA(m, None, lr_times_L=LR_L).step()
        with torch.no_grad():
            y1 = m(x)
        assert (y1 - y0).abs().max() <= 1e-12 * y0.abs().max()
        # The rescaled gradients are what a fresh backward at the new factors gives.
        gA, gB = m.lora_A.grad.clone(), m.lora_B.grad.clone()
        m.zero_grad()
        (m(x) * dy).sum().backward()
        torch.testing.assert_close(gA, m.lora_A.grad, rtol=1e-12, atol=1e-12 * gA.abs().max())
        torch.testing.assert_close(gB, m.lora_B.grad, rtol=1e-12, atol=1e-12 * gB.abs().max())
        # Which is: rows of ∇lora_A times α, columns of ∇lora_B times β (a nontrivial step).
        al, be = rep.alpha[0], rep.beta[0]
        assert torch.equal(gA, gA0 * al[:, None]) and torch.equal(gB, gB0 * be)
        assert not torch.allclose(al * be, torch.ones_like(al))


def _peft_lora_llama(use_dora=False):
    from peft import LoraConfig, get_peft_model

    from tests.parity.models import tiny_llama

    model = tiny_llama().double()
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        use_dora=use_dora,
    )
    pm = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=F64) / p.shape[-1] ** 0.5)
    return pm


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_peft_llama_output_unchanged(use_dora):
    from tests.parity.models import token_ids

    pm = _peft_lora_llama(use_dora)
    ids = token_ids(pm.config)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3)
    pm(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        y0 = pm(input_ids=ids).logits
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    W0 = q.base_layer.weight.clone()
    rep = ScaLoRA(pm, opt, lr_times_L=50.0).step()
    assert len(rep.names) == 6 and all(
        n.endswith(("q_proj", "v_proj", "down_proj")) for n in rep.names
    )
    assert rep.counts()["column"] + rep.counts()["scalar"] == 6
    assert not torch.equal(q.base_layer.weight, W0)
    with torch.no_grad():
        y1 = pm(input_ids=ids).logits
    assert (y1 - y0).abs().max() <= 1e-12 * y0.abs().max()
    opt.step()  # the optimizer runs on the rescaled state


def _dora_layer(seed=0, dtype=F64, d_in=12, d_out=10, r=3):
    torch.manual_seed(seed)
    layer = dora_torch.Linear(d_in, d_out, r=r, lora_alpha=6, dtype=dtype, impl="eager")
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.3)
        layer.lora_magnitude_vector.mul_(1 + 0.2 * torch.randn(d_out, dtype=dtype))
    return layer


@pytest.mark.parametrize("exact_norm_grad", [False, True])
def test_dora_linear_output_unchanged_and_norm_cache_exact(monkeypatch, exact_norm_grad):
    layer = _dora_layer()
    layer.exact_norm_grad = exact_norm_grad
    x = torch.randn(6, 12, dtype=F64)
    dy = torch.randn(6, 10, dtype=F64)
    y0 = layer(x)
    (y0 * dy).sum().backward()
    cache = layer._dora_norm_cache
    rep = ScaLoRA(layer, None, lr_times_L=2.0).step()
    assert rep.counts()["column"] + rep.counts()["scalar"] == 1
    W = layer.weight
    # ‖W‖² updated in O(d_out·r) equals a fresh pass over the merged W, keyed on W as it is.
    assert cache._base[0].matches(W)
    torch.testing.assert_close(cache._base[1], dora_torch.base_sq_norm(W), rtol=1e-12, atol=0)
    calls = []
    real = dora_torch.cache.base_sq_norm
    monkeypatch.setattr(dora_torch.cache, "base_sq_norm", lambda w: calls.append(1) or real(w))
    y1 = layer(x)
    assert calls == []  # the norm cache did not recompute ‖W‖²
    assert (y1 - y0).abs().max() <= 1e-12 * y0.abs().max()
    # The gradients are a fresh backward's at the new factors.
    gA, gB = layer.lora_A.grad.clone(), layer.lora_B.grad.clone()
    layer.zero_grad()
    (y1 * dy).sum().backward()
    torch.testing.assert_close(gA, layer.lora_A.grad, rtol=1e-10, atol=1e-12 * gA.abs().max())
    torch.testing.assert_close(gB, layer.lora_B.grad, rtol=1e-10, atol=1e-12 * gB.abs().max())


def test_dora_fp32_norm_update_close_and_bf16_recomputed():
    layer = _dora_layer(dtype=torch.float32)
    x = torch.randn(6, 12)
    layer(x).square().sum().backward()
    ScaLoRA(layer, None).step()
    cache = layer._dora_norm_cache
    assert cache._base[0].matches(layer.weight)
    fresh = dora_torch.base_sq_norm(layer.weight)
    torch.testing.assert_close(cache._base[1], fresh, rtol=1e-5, atol=0)
    # 16-bit base: the stored W is rounded, so the cache recomputes ‖W‖² lazily instead.
    layer = _dora_layer(dtype=torch.bfloat16)
    layer(x.bfloat16()).float().square().sum().backward()
    ScaLoRA(layer, None).step()
    assert not layer._dora_norm_cache._base[0].matches(layer.weight)


def test_accelerated_peft_dora_norm_cache_updated():
    from tests.parity.models import token_ids

    pm = dora_torch.accelerate_peft(_peft_lora_llama(use_dora=True), impl="eager")
    ids = token_ids(pm.config)
    pm(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        y0 = pm(input_ids=ids).logits
    ScaLoRA(pm, None, lr_times_L=50.0).step()
    for m in pm.modules():
        c = getattr(m, "_dora_norm_cache", None)
        if c is not None:
            W = m.get_base_layer().weight
            assert c._base[0].matches(W)
            torch.testing.assert_close(c._base[1], dora_torch.base_sq_norm(W), rtol=1e-12, atol=0)
    with torch.no_grad():
        y1 = pm(input_ids=ids).logits
    assert (y1 - y0).abs().max() <= 1e-12 * y0.abs().max()


# ---- optimizer state and the next step ----------------------------------------------------


def _adam_direction(g, m, v, t, b1, b2, vmax=None):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    if vmax is not None:  # amsgrad
        v = np.maximum(vmax, v)
    return (m / (1 - b1**t)) / np.sqrt(v / (1 - b2**t))


@pytest.mark.parametrize("kind", ["for_loop", "foreach", "fused", "adam_amsgrad"])
def test_adamw_state_transfer_and_next_step(kind):
    seed, d_out, d_in, r = CASES[1]
    W, A, B, s, _ = _data(seed, d_out, d_in, r)
    m = LoRA(*(torch.tensor(t) for t in (W, A, B)), s)
    lr, wd, b1, b2 = 0.01, 0.1, 0.9, 0.99
    params = [m.lora_A, m.lora_B]
    if kind == "adam_amsgrad":
        opt = torch.optim.Adam(params, lr=lr, betas=(b1, b2), eps=0.0, amsgrad=True)
        wd = 0.0
    else:
        opt = torch.optim.AdamW(
            params, lr=lr, betas=(b1, b2), eps=0.0, weight_decay=wd,
            foreach=kind == "foreach", fused=True if kind == "fused" else None,
        )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, d_in, dtype=F64, generator=g)
    dy = torch.randn(7, d_out, dtype=F64, generator=g)
    (m(x) * dy).sum().backward()
    opt.step()  # populate the state
    opt.zero_grad()
    (m(x).tanh() * dy).sum().backward()
    n = lambda t: t.detach().clone().numpy()  # noqa: E731
    lA, lB, gA, gB, W0 = n(m.lora_A), n(m.lora_B), n(m.lora_A.grad), n(m.lora_B.grad), n(m.weight)
    stA, stB = opt.state[m.lora_A], opt.state[m.lora_B]
    mA, vA, mB, vB = (n(stA["exp_avg"]), n(stA["exp_avg_sq"]), n(stB["exp_avg"]),
                      n(stB["exp_avg_sq"]))  # fmt: skip
    t = int(stA["step"]) + 1
    amsgrad = kind == "adam_amsgrad"
    xA, xB = (n(st["max_exp_avg_sq"]) if amsgrad else None for st in (stA, stB))

    rep = ScaLoRA(m, opt, lr_times_L=LR_L).step()
    al, be = rep.alpha[0].numpy(), rep.beta[0].numpy()
    want = S.transfer_adam_moments_torch(mA, vA, mB, vB, al, be)
    for got, w in zip((stA["exp_avg"], stA["exp_avg_sq"], stB["exp_avg"], stB["exp_avg_sq"]), want):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-13, atol=0)
    if amsgrad:
        np.testing.assert_allclose(stA["max_exp_avg_sq"].numpy(), xA * al[:, None] ** 2, rtol=1e-13)
        np.testing.assert_allclose(stB["max_exp_avg_sq"].numpy(), xB * be**2, rtol=1e-13)
    assert int(stA["step"]) == t - 1  # the step count is kept

    opt.step()
    # Equivariance (ε = 0): each factor takes the step the un-rescaled one would have taken;
    # decoupled decay scales with the (rescaled) parameter.
    DA = _adam_direction(gA, mA, vA, t, b1, b2, xA)
    DB = _adam_direction(gB, mB, vB, t, b1, b2, xB)
    lA1 = be[:, None] * lA * (1 - lr * wd) - lr * DA
    lB1 = lB * al * (1 - lr * wd) - lr * DB
    W1 = W0 + s * (lB * (1 - al * be)) @ lA
    _close(m.lora_A, lA1, 1e-12)
    _close(m.lora_B, lB1, 1e-12)
    _close(m.w_eff(), W1 + s * lB1 @ lA1, 1e-12)


def test_sgd_momentum_transfer():
    m, _ = _layer(*CASES[0])
    opt = torch.optim.SGD([m.lora_A, m.lora_B], lr=0.1, momentum=0.9)
    gA, gB = m.lora_A.grad.clone(), m.lora_B.grad.clone()
    opt.step()
    mA, mB = (opt.state[p]["momentum_buffer"].clone() for p in (m.lora_A, m.lora_B))
    m.lora_A.grad, m.lora_B.grad = gA, gB
    rep = ScaLoRA(m, opt, lr_times_L=LR_L).step()
    torch.testing.assert_close(opt.state[m.lora_A]["momentum_buffer"], mA * rep.alpha[0][:, None])
    torch.testing.assert_close(opt.state[m.lora_B]["momentum_buffer"], mB * rep.beta[0])


def test_register_and_interval():
    m, _ = _layer(*CASES[2])
    grads = (m.lora_A.grad.clone(), m.lora_B.grad.clone())
    opt = torch.optim.SGD([m.lora_A, m.lora_B], lr=1e-3)
    sc = ScaLoRA(m, opt, lr_times_L=LR_L, interval=3)
    handle = sc.register()
    merged = []
    for _ in range(8):
        m.lora_A.grad, m.lora_B.grad = (g.clone() for g in grads)
        W = m.weight.clone()
        opt.step()
        merged.append(sc.last_report.merged)
        assert sc.last_report.merged == (not torch.equal(W, m.weight))
    assert [i for i, x in enumerate(merged) if x] == [0, 3, 6]
    assert sc.state_dict() == {"steps": 8}
    handle.remove()
    opt.step()
    assert sc.steps == 8


# ---- master weights -----------------------------------------------------------------------


def test_master_weights_bf16():
    seed, d_out, d_in, r = CASES[3]
    W, A, B, s, _ = _data(seed, d_out, d_in, r)
    m = LoRA(torch.tensor(W).bfloat16(), torch.tensor(A).float(), torch.tensor(B).float(), s)
    sc = ScaLoRA(m, None, lr_times_L=LR_L, master_weights=True)
    ref = torch.tensor(W).bfloat16().double()  # float64 accumulation of the same merges
    rng = np.random.default_rng(0)
    for _ in range(20):
        G = rng.standard_normal((d_out, d_in))
        gA, gB = _grads(m.lora_A.detach().double().numpy(), m.lora_B.detach().double().numpy(),
                        s, G)  # fmt: skip
        m.lora_A.grad, m.lora_B.grad = torch.tensor(gA).float(), torch.tensor(gB).float()
        lA, lB = m.lora_A.detach().double(), m.lora_B.detach().double()
        rep = sc.step()
        c = 1 - rep.alpha[0] * rep.beta[0]
        ref += s * (lB * c) @ lA
    master = sc.master_weight(m.weight)
    assert master is not None and master.dtype == torch.float32
    assert torch.equal(m.weight, master.bfloat16())
    torch.testing.assert_close(master.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    # Rebuilt from W when W is written by anyone else.
    with torch.no_grad():
        m.weight.mul_(2)
    m.lora_A.grad, m.lora_B.grad = torch.tensor(gA).float(), torch.tensor(gB).float()
    sc.step()
    assert torch.equal(m.weight, sc.master_weight(m.weight).bfloat16())


def test_bf16_merge_in_row_chunks_is_the_one_product(monkeypatch):
    """A 16-bit base is merged through an fp32 product in chunks of
    ``config.SCALORA_MERGE_ELEMS // d_in`` rows: chunks of 2 rows with a tail give bit for
    bit the W of one chunk (each row's fp32 product and its one rounding do not depend on
    the chunking)."""
    from dora_torch import config

    seed, d_out, d_in, r = CASES[3]
    W, A, B, s, _ = _data(seed, d_out, d_in, r)
    G = np.random.default_rng(1).standard_normal((d_out, d_in))
    weights = []
    for elems in (d_out * d_in, 2 * d_in):
        monkeypatch.setattr(config, "SCALORA_MERGE_ELEMS", elems)
        m = LoRA(torch.tensor(W).bfloat16(), torch.tensor(A).float(), torch.tensor(B).float(), s)
        gA, gB = _grads(A, B, s, G)
        m.lora_A.grad, m.lora_B.grad = torch.tensor(gA).float(), torch.tensor(gB).float()
        ScaLoRA(m, None, lr_times_L=LR_L).step()
        weights.append(m.weight.detach().clone())
    assert d_out == 11  # chunks of 2 rows: five and a tail of one
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], torch.tensor(W).bfloat16())  # the merge did something


# ---- edge cases and errors ----------------------------------------------------------------


def test_zero_nonfinite_and_missing_gradients():
    ms = [_layer(*c)[0] for c in CASES[:4]]
    ms[0].lora_A.grad.zero_()
    ms[0].lora_B.grad.zero_()
    ms[1].lora_A.grad[0, 0] = float("nan")
    ms[2].lora_B.grad = None
    before = [(m.weight.clone(), m.lora_A.clone(), m.lora_B.clone()) for m in ms]
    rep = ScaLoRA(Stack(ms), None).step()
    b = rep.branches()
    assert b["layers.0"] == "zero_gradient" and b["layers.1"] == "nonfinite"
    assert rep.skipped == ("layers.2",) and "layers.3" in b
    for i in range(3):
        for t0, t1 in zip(before[i], (ms[i].weight, ms[i].lora_A, ms[i].lora_B)):
            assert torch.equal(t0, t1)
    assert not torch.equal(before[3][0], ms[3].weight)


def test_lora_B_zero_at_init():
    # PEFT's initialisation: B = 0, so ∇lora_A = 0 and K has zero rows (structural).
    seed, d_out, d_in, r = CASES[0]
    m, _ = _layer(seed, d_out, d_in, r)
    with torch.no_grad():
        m.lora_B.zero_()
    W, A, B, s = m.weight.clone(), m.lora_A.clone(), m.lora_B.clone(), m.s
    G = _data(seed, d_out, d_in, r)[4]
    gA, gB = _grads(A.detach().numpy(), B.detach().numpy(), s, G)
    m.lora_A.grad, m.lora_B.grad = torch.tensor(gA), torch.tensor(gB)
    Wn, An, Bn, res = _spec(m)
    rep = ScaLoRA(m, None, lr_times_L=LR_L).step()
    assert rep.branches()["LoRA"].split("/")[0] == res.branch
    _close(rep.beta[0], res.beta, 1e-10)
    _close(m.lora_A, An, 1e-10)
    _close(m.lora_B, Bn, 0)
    _close(m.weight, Wn, 0)
    assert torch.equal(m.weight, W) and torch.equal(m.lora_B, B)


def test_fan_in_fan_out_gpt2():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(cfg).double().eval()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    pm(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        y0 = pm(input_ids=ids).logits
    rep = ScaLoRA(pm, None, lr_times_L=5.0).step()
    assert len(rep.names) == 1
    with torch.no_grad():
        y1 = pm(input_ids=ids).logits
    assert (y1 - y0).abs().max() <= 1e-12 * y0.abs().max()


class _Int8Base(LoRA):
    def lora_factors(self):
        return self.weight.to(torch.int8), self.lora_A, self.lora_B, self.s


class _Sub(torch.Tensor):
    pass


class _SubclassBase(LoRA):
    def lora_factors(self):
        return self.weight.as_subclass(_Sub), self.lora_A, self.lora_B, self.s


def test_errors():
    m, _ = _layer(*CASES[0])
    with pytest.raises(TypeError, match=r"layer '_Int8Base'.*dtype torch.int8"):
        ScaLoRA(_Int8Base(m.weight, m.lora_A, m.lora_B, 1.0), None)
    with pytest.raises(TypeError, match=r"layer '_SubclassBase'.*_Sub"):
        ScaLoRA(_SubclassBase(m.weight, m.lora_A, m.lora_B, 1.0), None)
    trained = LoRA(m.weight, m.lora_A, m.lora_B, 1.0)
    trained.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"layer 'LoRA'.*requires grad"):
        ScaLoRA(trained, None)
    with pytest.raises(ValueError, match="no LoRA layers"):
        ScaLoRA(nn.Sequential(nn.Linear(3, 3)), None)
    with pytest.raises(TypeError, match="RMSprop"):
        ScaLoRA(m, torch.optim.RMSprop([m.lora_A, m.lora_B]))
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="lr_times_L"):
            ScaLoRA(m, None, lr_times_L=bad)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="interval"):
            ScaLoRA(m, None, interval=bad)
    m.lora_A.grad = m.lora_B.grad = None
    with pytest.raises(RuntimeError, match="no LoRA layer has gradients"):
        ScaLoRA(m, None).step()
    with pytest.raises(ValueError, match="optimizer"):
        ScaLoRA(m, None).register()


def test_errors_named_for_trained_base_in_stack():
    m, _ = _layer(*CASES[0])
    m.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"layer 'layers\.0'"):
        ScaLoRA(Stack([m]), None)


@pytest.mark.gpu
def test_step_does_not_sync_on_cuda():
    layers = []
    for i, (d_out, d_in, r) in enumerate([(64, 48, 4), (48, 64, 4), (80, 40, 8)]):
        m, _ = _layer(i, d_out, d_in, r, dtype=torch.float32)
        m.cuda()
        m.lora_A.grad, m.lora_B.grad = m.lora_A.grad.cuda(), m.lora_B.grad.cuda()
        layers.append(m)
    model = Stack(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    sc = ScaLoRA(model, opt)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rep = sc.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert sum(rep.counts().values()) == 3
    assert SC.BRANCHES[0] == "column"
