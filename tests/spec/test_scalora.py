"""ScaLoRA spec (shared_spec/scalora.py): optimality of the closed forms, the merge, the
AdamW moment transfer, the project-layout mapping and the edge cases.

The reference quantities here are built from the full gradient G (which the spec never
sees): M = ÃÃᵀG + GB̃B̃ᵀ and the bound −η⟨G, M⟩ + (Lη²/2)‖M‖².
"""

import numpy as np
import pytest

import shared_spec as S

scipy_optimize = pytest.importorskip("scipy.optimize")

LR, L = 0.3, 2.5  # the bound's η and L; the closed forms see only their product
ETA_L = LR * L


def _problem(seed, m=None, n=None, r=None, *, rank_G=None):
    rng = np.random.default_rng(seed)
    m = m or int(rng.integers(2, 8))
    n = n or int(rng.integers(2, 8))
    r = r or int(rng.integers(1, 4))
    A = rng.standard_normal((m, r))
    B = rng.standard_normal((n, r))
    if rank_G is None:
        G = rng.standard_normal((m, n))
    else:
        G = rng.standard_normal((m, rank_G)) @ rng.standard_normal((rank_G, n))
    return A, B, G


def _bound_G(At, Bt, G, lr=LR, L=L):
    """Reference bound − ℓ(W) for arbitrary trainable factors (Ã, B̃), from the full G."""
    M = At @ (At.T @ G) + (G @ Bt) @ Bt.T
    return -lr * np.sum(G * M) + 0.5 * L * lr * lr * np.sum(M * M)


def _bound_scaled(alpha, beta, A, B, G):
    return _bound_G(A * alpha, B * beta, G)


def _qp_from_G(A, B, G):
    """(K, λ) of the bound in w = [α²; β²], built independently from the rank-1 terms of M."""
    terms = [np.outer(a, G.T @ a) for a in A.T] + [np.outer(G @ b, b) for b in B.T]
    K = np.array([[np.sum(Mi * Mj) for Mj in terms] for Mi in terms])
    lam = np.array([np.sum(G * Mi) for Mi in terms])
    return K, lam


def _nnqp_min(K, lam, lr=LR, L=L):
    """min over w ≥ 0 of f(w) = −η λᵀw + (Lη²/2) wᵀKw (convex): the best column scaling.

    Two independent minimisers, the lower value wins: scipy's L-BFGS-B with bounds, and an
    exact active-set enumeration (the minimum is the stationary point of f on some face
    {w_i = 0, i ∉ F} that is feasible; 2r ≤ 6 here, so all faces are tried).
    """
    f = lambda w: -lr * lam @ w + 0.5 * L * lr * lr * (w @ K @ w)  # noqa: E731
    g = lambda w: -lr * lam + L * lr * lr * (K @ w)  # noqa: E731
    k = len(lam)
    res = scipy_optimize.minimize(
        f,
        np.full(k, 1.0 / ETA_L),
        jac=g,
        method="L-BFGS-B",
        bounds=[(0, None)] * k,
        options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 10_000},
    )
    best = res.fun
    for mask in range(1, 2**k):
        F = [i for i in range(k) if mask >> i & 1]
        w = np.zeros(k)
        w[F] = np.linalg.lstsq(K[np.ix_(F, F)], lam[F] / (L * lr), rcond=None)[0]
        if np.all(w >= 0):
            best = min(best, f(w))
    return best


def _scalar_min(A, B, G):
    """min over a, b ≥ 0 of the bound with Ã = √a·A, B̃ = √b·B (2 variables)."""
    K, lam = _qp_from_G(A, B, G)
    r = A.shape[1]
    P = np.zeros((2 * r, 2))
    P[:r, 0] = 1.0
    P[r:, 1] = 1.0
    return _nnqp_min(P.T @ K @ P, P.T @ lam)


def _grads(A, B, G):
    return G @ B, G.T @ A


def _scale(bound_value):
    return max(1.0, abs(bound_value))


# ---- the system and the bound ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_system_and_bound_match_full_gradient_forms(seed):
    A, B, G = _problem(seed)
    K, lam = S.column_system(A, B, *_grads(A, B, G))
    K_ref, lam_ref = _qp_from_G(A, B, G)
    np.testing.assert_allclose(K, K_ref, rtol=1e-12, atol=1e-12 * np.abs(K_ref).max())
    np.testing.assert_allclose(lam, lam_ref, rtol=1e-12, atol=1e-12 * np.abs(lam_ref).max())
    assert np.linalg.eigvalsh(K).min() > -1e-10 * np.abs(K).max()  # PSD (Schur product)
    rng = np.random.default_rng(100 + seed)
    for _ in range(3):
        al, be = rng.standard_normal(A.shape[1]), rng.standard_normal(A.shape[1])
        ref = _bound_scaled(al, be, A, B, G)
        got = S.scaling_bound(al, be, A, B, *_grads(A, B, G), LR, L)
        assert got == pytest.approx(ref, rel=1e-11, abs=1e-12)


def test_bound_is_the_first_order_model_of_the_sgd_step():
    # One SGD step of size η on (Ã, B̃) from the merged base moves W by −η M + η² G B̃ Ãᵀ G.
    A, B, G = _problem(3, 6, 5, 2)
    res = S.scalora_scaling(A, B, *_grads(A, B, G), ETA_L)
    W_pt = np.random.default_rng(0).standard_normal((6, 5))
    Wn, At, Bt = S.scalora_merge(W_pt, A, B, res.alpha, res.beta)
    At1, Bt1 = At - LR * G @ Bt, Bt - LR * G.T @ At
    dW = (Wn + At1 @ Bt1.T) - (W_pt + A @ B.T)
    M = At @ (At.T @ G) + (G @ Bt) @ Bt.T
    np.testing.assert_allclose(dW, -LR * M + LR**2 * G @ Bt @ At.T @ G, atol=1e-12)


def test_theorem1_svd_optimum_and_scaled_optimum_above_it():
    A, B, G = _problem(7, 9, 8, 3)
    r = 3
    U, sig, Vt = np.linalg.svd(G)
    c = 1.0 / np.sqrt(ETA_L)
    At, Bt = c * U[:, :r], c * Vt[r : 2 * r].T  # 𝒜 = {1..r}, ℬ = {r+1..2r}
    best = -np.sum(sig[: 2 * r] ** 2) / (2 * L)
    assert _bound_G(At, Bt, G) == pytest.approx(best, rel=1e-12)
    res = S.scalora_scaling(A, B, *_grads(A, B, G), ETA_L)
    assert _bound_scaled(res.alpha, res.beta, A, B, G) >= best - 1e-12


# ---- optimality of the closed forms -------------------------------------------------------


def _cases(n_cases=40):
    out = {"column": [], "scalar": []}
    for seed in range(n_cases):
        A, B, G = _problem(seed, rank_G=None if seed % 4 else 1)
        res = S.scalora_scaling(A, B, *_grads(A, B, G), ETA_L)
        out[res.branch].append((seed, A, B, G, res))
    return out


CASES = _cases(30)


def test_sweep_hits_both_branches():
    assert len(CASES["column"]) >= 10 and len(CASES["scalar"]) >= 5


@pytest.mark.parametrize("i", range(len(CASES["column"])))
def test_column_branch_is_the_global_minimum(i):
    _, A, B, G, res = CASES["column"][i]
    assert np.all(res.v >= -1e-12 * res.v.max())
    got = _bound_scaled(res.alpha, res.beta, A, B, G)
    K, lam = _qp_from_G(A, B, G)
    num = _nnqp_min(K, lam)
    tol = 1e-9 * _scale(num)
    assert got <= num + tol  # no column scaling does better ...
    assert got == pytest.approx(num, abs=10 * tol)  # ... and the minimiser attains it
    assert got == pytest.approx(-lam @ np.maximum(res.v, 0) / (2 * L), rel=1e-9, abs=1e-12)
    # Theorem 5's form: [α; β] = (Lη)^(-1/2) v^(1/2), + sign.
    v = np.maximum(res.v, 0)
    np.testing.assert_allclose(np.concatenate([res.alpha, res.beta]), np.sqrt(v / ETA_L))


@pytest.mark.parametrize("i", range(len(CASES["scalar"])))
def test_scalar_fallback_is_the_best_scalar_scaling(i):
    _, A, B, G, res = CASES["scalar"][i]
    assert res.v.min() < 0 and res.scalar_case in S.scalora.SCALAR_CASES
    r = A.shape[1]
    assert np.all(res.alpha == res.alpha[0]) and np.all(res.beta == res.beta[0])
    got = _bound_scaled(res.alpha, res.beta, A, B, G)
    num = _scalar_min(A, B, G)
    tol = 1e-9 * _scale(num)
    assert got <= num + tol and got == pytest.approx(num, abs=10 * tol)
    # The column optimum really is out of reach: the constrained column minimum lies
    # strictly above Theorem 5's unconstrained value −λᵀv/(2L), and below the scalar one.
    K, lam = _qp_from_G(A, B, G)
    col = _nnqp_min(K, lam)
    assert col > -lam @ res.v / (2 * L) + 1e-9 * _scale(col)
    assert col <= got + tol
    # Random scalar scalings never beat it (the bound is nonconvex in α, β themselves).
    rng = np.random.default_rng(i)
    for a, b in rng.standard_normal((50, 2)) / np.sqrt(ETA_L):
        assert got <= _bound_scaled(np.full(r, a), np.full(r, b), A, B, G) + tol


def _scalar_case_examples():
    """One problem per Theorem 3 case."""
    found = {}
    # "a_only": C^A = 6 > 0, C^B = −2 < 0, C = 11 (small integers found by a search).
    A = np.array([[0.0, 0.0], [-1.0, -1.0], [-1.0, 0.0]])
    B = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])
    G = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, -1.0, 1.0]])
    found["a_only"] = (A, B, G)
    found["b_only"] = (B, A, G.T)  # the mirror problem swaps the roles of α and β
    found["both"] = _problem(0, 5, 4, 2)
    _, B, G = _problem(1, 4, 3, 2)
    found["degenerate"] = (np.zeros((4, 2)), B, G)  # A = 0: ∇_B = 0, C = 0
    a, b = np.array([[1.0], [2.0], [0.0]]), np.array([[0.5], [-1.0]])
    found["degenerate_parallel"] = (a, b, 3.0 * a @ b.T)  # G = 3abᵀ: M's two terms parallel
    return found


SCALAR_EXAMPLES = _scalar_case_examples()


@pytest.mark.parametrize("name", ["a_only", "b_only", "both", "degenerate", "degenerate_parallel"])
def test_theorem3_every_case_minimises_the_scalar_bound(name):
    A, B, G = SCALAR_EXAMPLES[name]
    a, b, case = S.scalar_scaling(A, B, *_grads(A, B, G), ETA_L)
    assert case == name.removesuffix("_parallel")
    if case == "a_only":
        assert b == 0 and a == pytest.approx(
            np.linalg.norm(A.T @ G) / (np.sqrt(ETA_L) * np.linalg.norm(A @ A.T @ G)), rel=1e-12
        )
    if case == "b_only":
        assert a == 0 and b == pytest.approx(
            np.linalg.norm(G @ B) / (np.sqrt(ETA_L) * np.linalg.norm(G @ B @ B.T)), rel=1e-12
        )
    r = A.shape[1]
    got = _bound_scaled(np.full(r, a), np.full(r, b), A, B, G)
    num = _scalar_min(A, B, G)
    tol = 1e-9 * _scale(num)
    assert np.isfinite(got) and got <= num + tol and got == pytest.approx(num, abs=10 * tol)


@pytest.mark.parametrize("seed", range(6))
def test_rank_one_column_equals_scalar(seed):
    # r = 1: v ≥ 0 always (Cauchy–Schwarz), and Theorems 3 and 5 describe the same problem.
    A, B, G = _problem(seed, r=1)
    res = S.scalora_scaling(A, B, *_grads(A, B, G), ETA_L)
    assert res.branch == "column" and res.alpha.shape == (1,) and res.beta.shape == (1,)
    a, b, _ = S.scalar_scaling(A, B, *_grads(A, B, G), ETA_L)
    np.testing.assert_allclose([res.alpha[0], res.beta[0]], [a, b], rtol=1e-9, atol=1e-12)


def test_scales_are_invariant_to_gradient_size_and_covariant_in_the_factors():
    A, B, G = _problem(11, 6, 5, 3)
    ref = S.scalora_scaling(A, B, *_grads(A, B, G), ETA_L)
    for c in (1e-200, 1e-3, 1e5, 1e200):  # no under/overflow: only G's direction matters
        res = S.scalora_scaling(A, B, *_grads(A, B, c * G), ETA_L)
        assert res.branch == ref.branch
        np.testing.assert_allclose(res.alpha, ref.alpha, rtol=1e-10)
        np.testing.assert_allclose(res.beta, ref.beta, rtol=1e-10)
    res = S.scalora_scaling(3.0 * A, B, *_grads(3.0 * A, B, G), ETA_L)
    np.testing.assert_allclose(res.alpha, ref.alpha / 3.0, rtol=1e-9)  # Ã is unchanged
    res = S.scalora_scaling(A, B, *_grads(A, B, G), 4.0 * ETA_L)
    np.testing.assert_allclose(res.alpha, ref.alpha / 2.0, rtol=1e-12)  # ∝ (Lη)^(-1/2)


# ---- the merge ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 5])
def test_merge_leaves_the_layer_unchanged(seed):
    A, B, G = _problem(seed, 7, 6, 3)
    rng = np.random.default_rng(seed)
    W_pt = rng.standard_normal((7, 6))
    x = rng.standard_normal((6, 4))
    for alpha, beta in (
        (S.scalora_scaling(A, B, *_grads(A, B, G), ETA_L)[:2]),
        (rng.standard_normal(3), rng.standard_normal(3)),
        (np.zeros(3), np.ones(3)),
    ):
        Wn, At, Bt = S.scalora_merge(W_pt, A, B, alpha, beta)
        np.testing.assert_array_equal(At, A * alpha)
        np.testing.assert_array_equal(Bt, B * beta)
        y0 = (W_pt + A @ B.T) @ x
        y1 = Wn @ x + At @ (Bt.T @ x)
        assert np.linalg.norm(y1 - y0) <= 1e-12 * np.linalg.norm(y0)


# ---- AdamW moment transfer ----------------------------------------------------------------


def _adamw(p, g, m, v, t, lr=1e-2, b1=0.9, b2=0.999, eps=0.0, wd=0.0):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction); t = new step."""
    p = p * (1.0 - lr * wd)
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    mh, vh = m / (1.0 - b1**t), v / (1.0 - b2**t)
    return p - lr * mh / (np.sqrt(vh) + eps), m, v


def _loss_grad(W, X, Y):
    """ℓ(W) = ||W X − Y||² / (2N): returns G = ∇ℓ(W)."""
    return (W @ X - Y) @ X.T / X.shape[1]


def test_adamw_transfer_is_equivariant_and_keeps_the_next_step():
    rng = np.random.default_rng(4)
    m, n, r, N = 6, 5, 2, 16
    W_pt = rng.standard_normal((m, n))
    A, B = rng.standard_normal((m, r)), 0.5 * rng.standard_normal((n, r))
    X, Y = rng.standard_normal((n, N)), rng.standard_normal((m, N))
    mA, vA, mB, vB = (np.zeros((k, r)) for k in (m, m, n, n))
    hist = []
    for t in range(1, 4):  # some AdamW history on (A, B)
        G = _loss_grad(W_pt + A @ B.T, X, Y)
        gA, gB = G @ B, G.T @ A
        hist.append((gA, gB))
        A, mA, vA = _adamw(A, gA, mA, vA, t)
        B, mB, vB = _adamw(B, gB, mB, vB, t)

    G = _loss_grad(W_pt + A @ B.T, X, Y)
    gA, gB = G @ B, G.T @ A
    res = S.scalora_scaling(A, B, gA, gB, 50.0)
    assert res.branch == "column" and np.all(res.alpha > 0) and np.all(res.beta > 0)
    al, be = res.alpha, res.beta
    assert not np.allclose(al * be, 1.0)  # a real merge, not a pure reparametrisation
    Wn, At, Bt = S.scalora_merge(W_pt, A, B, al, be)
    tmA, tvA, tmB, tvB = S.transfer_adam_moments(mA, vA, mB, vB, al, be)

    # The merge keeps W, so G; the new factors' gradients are the old ones scaled by β, α.
    Gn = _loss_grad(Wn + At @ Bt.T, X, Y)
    np.testing.assert_allclose(Gn, G, atol=1e-12)
    gAt, gBt = Gn @ Bt, Gn.T @ At
    np.testing.assert_allclose(gAt, gA * be, atol=1e-12)
    np.testing.assert_allclose(gBt, gB * al, atol=1e-12)

    # The transferred moments are the moments of the transformed gradient history.
    hm = hv = 0.0
    for gA_, _ in hist:
        hm, hv = 0.9 * hm + 0.1 * gA_ * be, 0.999 * hv + 0.001 * (gA_ * be) ** 2
    np.testing.assert_allclose(tmA, hm, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(tvA, hv, rtol=1e-12, atol=1e-15)

    # Equivariance: transfer ∘ update = update ∘ transfer, and (ε = 0, no decay) the
    # rescaled factors take exactly the step the old ones would have taken.
    A1, mA1, vA1 = _adamw(A, gA, mA, vA, 4)
    B1, mB1, vB1 = _adamw(B, gB, mB, vB, 4)
    At1, tmA1, tvA1 = _adamw(At, gAt, tmA, tvA, 4)
    Bt1, tmB1, tvB1 = _adamw(Bt, gBt, tmB, tvB, 4)
    for got, want in zip(
        (tmA1, tvA1, tmB1, tvB1), S.transfer_adam_moments(mA1, vA1, mB1, vB1, al, be)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-18)
    np.testing.assert_allclose(At1 - At, A1 - A, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(Bt1 - Bt, B1 - B, rtol=1e-10, atol=1e-14)

    # With ε > 0 the step in column j uses ε/|β_j| (resp. ε/|α_j|): exactly, for any ε.
    eps = 1e-3
    np.testing.assert_allclose(
        _adamw(At, gAt, tmA, tvA, 4, eps=eps)[0] - At,
        _adamw(A, gA, mA, vA, 4, eps=eps / be)[0] - A,
        rtol=1e-10,
        atol=1e-14,
    )
    np.testing.assert_allclose(
        _adamw(Bt, gBt, tmB, tvB, 4, eps=eps)[0] - Bt,
        _adamw(B, gB, mB, vB, 4, eps=eps / al)[0] - B,
        rtol=1e-10,
        atol=1e-14,
    )


def test_transfer_with_zero_scale_gives_a_consistent_state():
    # β_j = 0 (scalar case "a_only", or v_j = 0): B̃'s column j and ∇_Ã's column j are 0,
    # and so is the transferred state of that column: a finite, exact state.
    rng = np.random.default_rng(0)
    mA, vA = rng.standard_normal((4, 2)), rng.random((4, 2))
    mB, vB = rng.standard_normal((3, 2)), rng.random((3, 2))
    tmA, tvA, _, tvB = S.transfer_adam_moments(mA, vA, mB, vB, [2.0, 0.5], [0.0, 3.0])
    assert np.all(tmA[:, 0] == 0) and np.all(tvA[:, 0] == 0)
    np.testing.assert_allclose(tvB, vB * [4.0, 0.25])
    p, _, _ = _adamw(np.ones((4, 2)), np.zeros((4, 2)), tmA, tvA, 5, eps=1e-8)
    assert np.all(np.isfinite(p)) and np.all(p[:, 0] == 1.0)


# ---- project (PyTorch) layout -------------------------------------------------------------


def test_torch_layout_mapping():
    rng = np.random.default_rng(8)
    d_out, d_in, r, s, lr = 6, 5, 3, 1.7, 0.05
    W = rng.standard_normal((d_out, d_in))
    lA, lB = rng.standard_normal((r, d_in)), rng.standard_normal((d_out, r))
    G = rng.standard_normal((d_out, d_in))  # ∇ℓ at W + s·lB·lA
    glA, glB = s * lB.T @ G, s * G @ lA.T  # autograd's gradients of lora_A, lora_B
    A, B = S.to_paper_layout(lA, lB, s)
    np.testing.assert_allclose(A @ B.T, s * lB @ lA, atol=1e-12)
    gA, gB = S.grads_to_paper_layout(glA, glB, s)
    np.testing.assert_allclose(gA, G @ B, atol=1e-12)
    np.testing.assert_allclose(gB, G.T @ A, atol=1e-12)
    # SGD with step η on (lora_A, lora_B) is SGD with step s·η on (A, B).
    A1, B1 = S.to_paper_layout(lA - lr * glA, lB - lr * glB, s)
    np.testing.assert_allclose(A1, A - s * lr * gA, atol=1e-12)
    np.testing.assert_allclose(B1, B - s * lr * gB, atol=1e-12)

    lr_L = 0.4
    Wn, lAn, lBn, res = S.scalora_step_torch(W, lA, lB, glA, glB, s, lr_L)
    ref = S.scalora_scaling(A, B, gA, gB, s * lr_L)
    np.testing.assert_allclose(res.alpha, ref.alpha, rtol=1e-12)
    np.testing.assert_allclose(res.beta, ref.beta, rtol=1e-12)
    np.testing.assert_allclose(lBn, lB * res.alpha)
    np.testing.assert_allclose(lAn, res.beta[:, None] * lA)
    x = rng.standard_normal((4, d_in))
    y0 = x @ (W + s * lB @ lA).T
    y1 = x @ Wn.T + s * (x @ lAn.T) @ lBn.T
    assert np.linalg.norm(y1 - y0) <= 1e-12 * np.linalg.norm(y0)
    Wp = S.scalora_merge(W, A, B, res.alpha, res.beta)[0]
    np.testing.assert_allclose(Wn, Wp, atol=1e-12)

    mlA, vlA = rng.standard_normal((r, d_in)), rng.random((r, d_in))
    mlB, vlB = rng.standard_normal((d_out, r)), rng.random((d_out, r))
    got = S.transfer_adam_moments_torch(mlA, vlA, mlB, vlB, res.alpha, res.beta)
    tmA, tvA, tmB, tvB = S.transfer_adam_moments(mlB, vlB, mlA.T, vlA.T, res.alpha, res.beta)
    for g, w in zip(got, (tmB.T, tvB.T, tmA, tvA)):
        np.testing.assert_allclose(g, w, rtol=1e-15)


# ---- edge cases ---------------------------------------------------------------------------


def test_zero_gradient_is_a_no_op():
    A, B, _ = _problem(2, 5, 4, 2)
    z = np.zeros_like
    res = S.scalora_scaling(A, B, z(A), z(B), ETA_L)
    assert res.branch == "zero_gradient" and res.v is None and res.scalar_case is None
    np.testing.assert_array_equal(res.alpha, np.ones(2))
    np.testing.assert_array_equal(res.beta, np.ones(2))
    W_pt = np.arange(20.0).reshape(5, 4)
    Wn, At, Bt = S.scalora_merge(W_pt, A, B, res.alpha, res.beta)
    np.testing.assert_array_equal(Wn, W_pt)
    np.testing.assert_array_equal(At, A)
    np.testing.assert_array_equal(Bt, B)
    # The bound is flat there: every scaling is optimal.
    assert S.scaling_bound([3.0, -1.0], [0.2, 7.0], A, B, z(A), z(B), LR, L) == 0.0
    with pytest.raises(ValueError, match="nonzero"):
        S.scalar_scaling(A, B, z(A), z(B), ETA_L)
    # G ≠ 0 but orthogonal to both factors' spaces: the LoRA gradients vanish too.
    A2, B2 = np.eye(4)[:, :2], np.eye(3)[:, :2]
    G = np.zeros((4, 3))
    G[3, 2] = 1.0
    assert S.scalora_scaling(A2, B2, G @ B2, G.T @ A2, ETA_L).branch == "zero_gradient"


def test_lora_init_zero_factor_is_finite_and_optimal():
    # lora_B = 0 at LoRA's init, i.e. A = 0: K is singular, ∇_B = 0.
    _, B, G = _problem(5, 5, 4, 2)
    A = np.zeros((5, 2))
    res = S.scalora_scaling(A, B, *_grads(A, B, G), ETA_L)
    assert np.all(np.isfinite(res.alpha)) and np.all(np.isfinite(res.beta))
    got = _bound_scaled(res.alpha, res.beta, A, B, G)
    best = _nnqp_min(*_qp_from_G(A, B, G)) if res.branch == "column" else _scalar_min(A, B, G)
    assert got <= best + 1e-9 * _scale(best) and got < 0


def test_v_rounding_tolerance():
    # Exact zeros in v come out as ±1e-16; they must not push the case to the fallback.
    A = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    B = np.array([[1.0, 0.1], [0.0, 1.0], [0.0, 0.0]])
    G = np.eye(3)
    res = S.scalora_scaling(A, B, *_grads(A, B, G), ETA_L)
    assert res.branch == "column"
    assert np.all(res.alpha >= 0) and np.all(res.beta >= 0)


@pytest.mark.parametrize(
    "shapes, match, shown",
    [
        (((4, 2), (3, 3), (4, 2), (3, 3)), "rank mismatch", "(3, 3)"),
        (((4,), (3, 2), (4, 2), (3, 2)), "A must be 2-D", "(4,)"),
        (((4, 2), (3, 2, 1), (4, 2), (3, 2)), "B must be 2-D", "(3, 2, 1)"),
        (((4, 2), (3, 2), (2, 4), (3, 2)), "grad_A must have the shape of A", "(2, 4)"),
        (((4, 2), (3, 2), (4, 2), (4, 2)), "grad_B must have the shape of B", "(4, 2)"),
        (((4, 0), (3, 0), (4, 0), (3, 0)), "rank must be at least 1", "(4, 0)"),
    ],
)
def test_bad_shapes_name_the_argument(shapes, match, shown):
    A, B, gA, gB = (np.ones(s) for s in shapes)
    for fn in (
        lambda: S.scalora_scaling(A, B, gA, gB, ETA_L),
        lambda: S.scalar_scaling(A, B, gA, gB, ETA_L),
        lambda: S.column_system(A, B, gA, gB),
        lambda: S.scaling_bound(np.ones(2), np.ones(2), A, B, gA, gB, LR, L),
    ):
        with pytest.raises(ValueError, match=match) as e:
            fn()
        assert shown in str(e.value)


def test_bad_arguments_elsewhere():
    A, B, G = _problem(0, 4, 3, 2)
    gA, gB = _grads(A, B, G)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lr_times_L"):
            S.scalora_scaling(A, B, gA, gB, bad)
    nan = np.full_like(gA, np.nan)
    with pytest.raises(ValueError, match="grad_A must be finite"):
        S.scalora_scaling(A, B, nan, gB, ETA_L)
    with pytest.raises(ValueError, match="B must be finite"):
        S.scalora_scaling(A, B * np.inf, gA, gB, ETA_L)
    with pytest.raises(ValueError, match=r"^lr "):
        S.scaling_bound(np.ones(2), np.ones(2), A, B, gA, gB, 0.0, L)
    with pytest.raises(ValueError, match=r"alpha must have shape \[r\]"):
        S.scaling_bound(np.ones(3), np.ones(2), A, B, gA, gB, LR, L)
    with pytest.raises(ValueError, match="beta must have shape"):
        S.scalora_merge(np.zeros((4, 3)), A, B, np.ones(2), np.ones((2, 1)))
    with pytest.raises(ValueError, match="W_pt must have shape"):
        S.scalora_merge(np.zeros((3, 4)), A, B, np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="exp_avg_sq_A must have the shape"):
        S.transfer_adam_moments(gA, gA[:, :1], gB, gB, np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="rank mismatch: exp_avg_A"):
        S.transfer_adam_moments(gA, gA, gB[:, :1], gB[:, :1], np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="exp_avg_B must be 2-D"):
        S.transfer_adam_moments(gA, gA, gB[:, 0], gB, np.ones(2), np.ones(2))
    lA, lB = B.T, A  # project layout: lora_A [r, d_in], lora_B [d_out, r]
    with pytest.raises(ValueError, match="scaling"):
        S.scalora_step_torch(np.zeros((4, 3)), lA, lB, lA, lB, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"must have shape \[d_out, r\]"):
        S.scalora_step_torch(np.zeros((4, 3)), lA, lB[:3], lA, lB[:3], 1.0, 1.0)
    with pytest.raises(ValueError, match="grad_lora_B"):
        S.scalora_step_torch(np.zeros((4, 3)), lA, lB, lA, lB.T, 1.0, 1.0)
    with pytest.raises(ValueError, match="exp_avg_sq_lora_B must have the shape"):
        S.transfer_adam_moments_torch(lA, lA, lB, lB.T, np.ones(2), np.ones(2))
