"""ScaLoRA: optimally scaled LoRA columns (Zhang, Yang, Cai, Giannakis, arXiv 2510.23818).

Paper layout (every function here except those at the end, which take the project layout):

    W = W_pt + A Bᵀ,   W [m, n],  A [m, r],  B [n, r],   G = ∇ℓ(W) [m, n]
    ∇_A = G B [m, r],  ∇_B = Gᵀ A [n, r]       (the LoRA gradients; G itself is never needed)

Project (PyTorch) layout: W [d_out, d_in], lora_A [r, d_in], lora_B [d_out, r] and
W_eff = W + s·lora_B·lora_A. The map splits the scale s > 0 evenly:

    m = d_out, n = d_in,   A = √s·lora_B,   B = √s·lora_Aᵀ         (so A Bᵀ = s·lora_B·lora_A)
    ∇_A = ∇_{lora_B} / √s,  ∇_B = (∇_{lora_A})ᵀ / √s

With the even split, an SGD step of size η on (lora_A, lora_B) is exactly an SGD step of
size s·η on (A, B); so the paper's ``Lη`` is ``s·L·η`` in project units. Column scalings
carry over unchanged: Ã = A diag(α) is lora_B diag(α), B̃ = B diag(β) is diag(β) lora_A.

The step. At iteration t, merge and rescale (the layer's function is unchanged):

    W_pt ← W_pt + A diag(1 − α⊙β) Bᵀ,   A ← A diag(α),   B ← B diag(β)

then keep training (Ã, B̃). One (S)GD step of size η from there changes W by
ΔW̃ = −η M + O(η²) with M = ÃÃᵀG + GB̃B̃ᵀ, and L-smoothness bounds the loss (the paper's
surrogate; the O(η²) term η²·G B̃ Ãᵀ G is dropped, as Theorem 1's optimum
Ã = (Lη)^{-1/2} U_𝒜 P requires):

    ℓ(W + ΔW̃) ≤ ℓ(W) − η⟨G, M⟩ + (Lη²/2)‖M‖²_F = ℓ(W) + (L/2)‖ΔW* − ΔW̃‖² − ‖G‖²/(2L)

with ΔW* = −G/L. Theorem 1: over all rank-r (Ã, B̃) the minimum is −‖G_{2r}‖²/(2L)
(truncated SVD; too costly). With column scalings, w = [α∘²; β∘²] ∈ R^{2r}_{≥0} and

    S_A = [A, ∇_A] [m, 2r],   S_B = [∇_B, B] [n, 2r],   M = S_A diag(w) S_Bᵀ
    λ = [‖∇_B[:, i]‖²]_i ++ [‖∇_A[:, j]‖²]_j = [‖Gᵀa_i‖²] ++ [‖G b_j‖²]
    K = (S_AᵀS_A) ⊙ (S_BᵀS_B)   (2r × 2r, PSD: the Gram matrix of the rank-1 terms of M)
    bound − ℓ(W) = −η λᵀw + (Lη²/2) wᵀ K w                                  (convex in w)

Theorem 5 (column scaling): if K v = λ has a solution v ≥ 0 then
[α; β] = ±(Lη)^{-1/2} v^{∘1/2} is a global minimiser, with value −λᵀv/(2L). (λ is always in
the range of K, so K v = λ is always consistent; v is unique iff K is nonsingular.)

Theorem 3 (scalar scaling, the fallback when v has a negative entry): Ã = αA, B̃ = βB,
a = α², b = β²; with p = ‖AᵀG‖², q = ‖GB‖², x = ‖AAᵀG‖², y = ‖GBBᵀ‖², z = ‖AᵀGB‖²
(all Frobenius; computed from r×r blocks of K and λ: p = Σλ_A, q = Σλ_B, x = ΣK_AA,
y = ΣK_BB, z = ΣK_AB) and

    C^A = p·y − q·z,   C^B = q·x − p·z,   C = x·y − z² ≥ 0   (Cauchy–Schwarz)

the minimiser over a, b ≥ 0 of −η(pa + qb) + (Lη²/2)(x a² + 2z ab + y b²) is

    case "a_only":  C^A > 0, C^B ≤ 0:          (α, β) = (±√p / (√(Lη)·√x), 0)
    case "b_only":  C^A ≤ 0, C^B > 0:          (α, β) = (0, ±√q / (√(Lη)·√y))
    case "both":    C^A ≥ 0, C^B ≥ 0, C > 0:   (α, β) = (±√(C^A/(LηC)), ±√(C^B/(LηC)))

If C > 0 these cases are exhaustive; C = 0 forces C^A = C^B = 0 (M's two terms are
parallel, or one is zero) and the bound depends on (a, b) only through d = (√x, √y):
case "degenerate" returns the minimum-norm minimiser (a, b) = t·d, t = (p√x + q√y)/(Lη dᵀHd),
H = [[x, z], [z, y]].

Sign rule. The bound depends on α∘², β∘² only, so every sign pattern attains it; the paper
writes ±. We return the + root throughout: each rescaled column keeps its orientation, a
step with α⊙β = 1 is a no-op merge, and the transferred moments keep their signs.

Branch rule (the paper's hybrid): "column" if the (minimum-norm) solution v of K v = λ
satisfies v ≥ −tol·max(v) (entries in [−tol·max(v), 0) are rounding and set to 0);
otherwise "scalar". When K is singular only the minimum-norm solution is tested; a
nonnegative solution elsewhere in v + null(K) is not searched for (that would be an LP
feasibility problem). "zero_gradient" (our convention; the paper does not cover it): when
∇_A = 0 and ∇_B = 0 the bound is identically ℓ(W), every scaling is optimal, and we return
α = β = 1 so the merge is a no-op (the α = β = 0 that the minimum-norm rule would give would
leave a dead adapter: Ã = B̃ = 0 is a stationary point of LoRA training).

AdamW moments (derived here; see ``transfer_adam_moments``): the merge leaves W, hence G,
unchanged, so ∇_Ã = G B̃ = ∇_A diag(β) and ∇_B̃ = ∇_B diag(α). The moments are linear and
quadratic in past gradients, so they transfer as the gradients do:

    m_Ã = m_A diag(β),  v_Ã = v_A diag(β∘²),   m_B̃ = m_B diag(α),  v_B̃ = v_B diag(α∘²)

(O((m+n)r), step count unchanged). Equivariance: transferring then updating the moments
with the new gradient equals updating then transferring, and with ε = 0 AdamW's next
direction m̂/√v̂ is unchanged (times sign(β), sign(α); both + here), so (Ã, B̃) move by
exactly the step (A, B) would have taken. With ε > 0 the step uses ε/|β_j| in column j.

Sources and disagreements. The full paper text was not readable offline (only its abstract);
the formulas above follow /work/shared/papers/scalora-summary.txt and were re-derived from
the bound, and the tests check them against numerical minimisers. Where they differ:
- Theorem 3 in the summary is truncated: its first case is lost, and C^A, C^B, C are not
  defined there; the definitions above are derived. Its "a_only" case prints
  ‖AᵀG‖/√(Lη‖AAᵀG‖); it must be ‖AᵀG‖/√(Lη‖AAᵀG‖²) = ‖AᵀG‖/(√(Lη)‖AAᵀG‖) (the printed form is
  not invariant to G → cG, which leaves the bound's minimiser unchanged).
- The summary's algorithm says "positive solution", its Theorem 5 "nonnegative"; we follow
  Theorem 5 (v ≥ 0; a zero entry zeroes that column, which is still a minimiser).
- The AdamW moment transfer is not stated in the summary; the rule above is derived.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .shapes import check_adapter

BRANCHES = ("column", "scalar", "zero_gradient")
SCALAR_CASES = ("a_only", "b_only", "both", "degenerate")


class ScaLoRAScaling(NamedTuple):
    """Result of ``scalora_scaling``.

    alpha, beta: [r] float64, the column scales of A and B.
    branch: "column" (Theorem 5), "scalar" (Theorem 3) or "zero_gradient".
    v: [2r] minimum-norm solution of K v = λ (None for "zero_gradient"); its sign decides
       the branch.
    scalar_case: for branch "scalar", one of SCALAR_CASES; otherwise None.
    """

    alpha: np.ndarray
    beta: np.ndarray
    branch: str
    v: np.ndarray | None
    scalar_case: str | None


def _shape(a) -> tuple[int, ...]:
    return tuple(np.shape(a))


def _check_factors(A, B, grad_A=None, grad_B=None) -> tuple[int, int, int]:
    """Validate paper-layout factors (and gradients); return (m, n, r)."""
    if np.ndim(A) != 2:
        raise ValueError(f"A must be 2-D [m, r]; got shape {_shape(A)}")
    if np.ndim(B) != 2:
        raise ValueError(f"B must be 2-D [n, r]; got shape {_shape(B)}")
    (m, r), (n, rb) = _shape(A), _shape(B)
    if rb != r:
        raise ValueError(
            f"rank mismatch: A {_shape(A)} has rank {r} but B {_shape(B)} has rank {rb}"
        )
    if r < 1:
        raise ValueError(f"rank must be at least 1; got A {_shape(A)}")
    for name, g, like, want in (("grad_A", grad_A, "A", (m, r)), ("grad_B", grad_B, "B", (n, r))):
        if g is not None and _shape(g) != want:
            raise ValueError(f"{name} must have the shape of {like} {want}; got {_shape(g)}")
    return m, n, r


def _check_scales(alpha, beta, r: int):
    for name, v in (("alpha", alpha), ("beta", beta)):
        if _shape(v) != (r,):
            raise ValueError(f"{name} must have shape [r] = ({r},); got {_shape(v)}")
    return np.asarray(alpha, np.float64), np.asarray(beta, np.float64)


def _positive(name: str, value) -> float:
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive finite number; got {value!r}")
    return v


def _f64(*ts):
    return tuple(np.asarray(t, np.float64) for t in ts)


def column_system(A, B, grad_A, grad_B) -> tuple[np.ndarray, np.ndarray]:
    """Theorem 5's system: ``(K, λ)`` with K = (S_AᵀS_A) ⊙ (S_BᵀS_B) [2r, 2r], λ [2r].

    S_A = [A, ∇_A], S_B = [∇_B, B]; λ = column norms² of [∇_B, ∇_A]. Cost O((m+n)r²).
    """
    _check_factors(A, B, grad_A, grad_B)
    A, B, gA, gB = _f64(A, B, grad_A, grad_B)
    SA = np.concatenate([A, gA], axis=1)
    SB = np.concatenate([gB, B], axis=1)
    K = (SA.T @ SA) * (SB.T @ SB)
    lam = np.concatenate([np.sum(gB * gB, axis=0), np.sum(gA * gA, axis=0)])
    return K, lam


def scaling_bound(alpha, beta, A, B, grad_A, grad_B, lr, L) -> float:
    """The L-smooth bound after one step of size η = lr, minus ℓ(W):

        U(α, β) − ℓ(W) = −η λᵀw + (Lη²/2) wᵀ K w,   w = [α∘²; β∘²]
                       = −η⟨G, M⟩ + (Lη²/2)‖M‖²_F,  M = ÃÃᵀG + GB̃B̃ᵀ, Ã = A diag(α), B̃ = B diag(β)

    Scalar scaling is the special case alpha = α·1, beta = β·1.
    """
    _, _, r = _check_factors(A, B, grad_A, grad_B)
    alpha, beta = _check_scales(alpha, beta, r)
    eta, L = _positive("lr", lr), _positive("L", L)
    K, lam = column_system(A, B, grad_A, grad_B)
    w = np.concatenate([alpha**2, beta**2])
    return float(-eta * lam @ w + 0.5 * L * eta * eta * (w @ K @ w))


def scalar_scaling(A, B, grad_A, grad_B, lr_times_L) -> tuple[float, float, str]:
    """Theorem 3: the best common scales (α, β) for Ã = αA, B̃ = βB (module doc).

    Returns (alpha, beta, case), case in SCALAR_CASES. Requires ∇_A, ∇_B not both zero.
    """
    _, _, r = _check_factors(A, B, grad_A, grad_B)
    eL = _positive("lr_times_L", lr_times_L)
    K, lam = column_system(A, B, *_normalized_grads(grad_A, grad_B))
    return _scalar_from_system(K, lam, r, eL)


def _normalized_grads(grad_A, grad_B):
    # K and λ are both quadratic in G, so v (and Theorem 3's a, b) do not depend on |G|:
    # dividing by the largest entry avoids under/overflow for tiny or huge gradients.
    gA, gB = _f64(grad_A, grad_B)
    for name, g in (("grad_A", gA), ("grad_B", gB)):
        if not np.all(np.isfinite(g)):
            raise ValueError(f"{name} must be finite; it has NaN or inf entries")
    c = max(float(np.max(np.abs(gA))), float(np.max(np.abs(gB))))
    if c == 0.0:
        raise ValueError("scalar_scaling needs grad_A or grad_B to be nonzero")
    return gA / c, gB / c


def _scalar_from_system(K, lam, r: int, eL: float) -> tuple[float, float, str]:
    p, q = float(lam[:r].sum()), float(lam[r:].sum())
    x, y, z = float(K[:r, :r].sum()), float(K[r:, r:].sum()), float(K[:r, r:].sum())
    CA, CB, C = p * y - q * z, q * x - p * z, x * y - z * z
    if C > 1e-12 * x * y:
        if CA >= 0 and CB >= 0:
            return math.sqrt(CA / (eL * C)), math.sqrt(CB / (eL * C)), "both"
        if CA > 0:  # then C^B < 0
            return math.sqrt(p / (eL * x)), 0.0, "a_only"
        return 0.0, math.sqrt(q / (eL * y)), "b_only"  # C^B > 0, C^A < 0
    d = np.array([math.sqrt(x), math.sqrt(y)])
    H = np.array([[x, z], [z, y]])
    t = (p * d[0] + q * d[1]) / (eL * float(d @ H @ d))
    a, b = t * d
    return math.sqrt(a), math.sqrt(b), "degenerate"


def scalora_scaling(A, B, grad_A, grad_B, lr_times_L, *, tol: float = 1e-12) -> ScaLoRAScaling:
    """The optimal column scales (α, β) of ScaLoRA and the branch taken (module doc).

    A [m, r], B [n, r]: the factors (paper layout). grad_A = ∇_A = G B [m, r] and
    grad_B = ∇_B = Gᵀ A [n, r]: the LoRA gradients at the current W. lr_times_L: L·η > 0.
    tol: relative slack for v ≥ 0 (rounding of exact zeros in v).
    Cost O((m+n)r² + r³); never forms an [m, n] matrix.
    """
    _, _, r = _check_factors(A, B, grad_A, grad_B)
    eL = _positive("lr_times_L", lr_times_L)
    A, B, gA, gB = _f64(A, B, grad_A, grad_B)
    for name, t in (("A", A), ("B", B)):
        if not np.all(np.isfinite(t)):
            raise ValueError(f"{name} must be finite; it has NaN or inf entries")
    if not (np.any(gA) or np.any(gB)):
        one = np.ones(r)
        return ScaLoRAScaling(one, one.copy(), "zero_gradient", None, None)
    K, lam = column_system(A, B, *_normalized_grads(gA, gB))
    v = np.linalg.lstsq(K, lam, rcond=None)[0]
    if np.all(v >= -tol * np.max(v)):
        s = np.sqrt(np.maximum(v, 0.0) / eL)
        return ScaLoRAScaling(s[:r], s[r:], "column", v, None)
    a, b, case = _scalar_from_system(K, lam, r, eL)
    return ScaLoRAScaling(np.full(r, a), np.full(r, b), "scalar", v, case)


def scalora_merge(W_pt, A, B, alpha, beta) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The merge: ``(W_pt + A diag(1 − α⊙β) Bᵀ,  A diag(α),  B diag(β))``.

    W_pt [m, n]. W_pt + A Bᵀ is unchanged: new W_pt + Ã B̃ᵀ equals it exactly in real
    arithmetic (and to rounding in float64).
    """
    m, n, r = _check_factors(A, B)
    if _shape(W_pt) != (m, n):
        raise ValueError(
            f"W_pt must have shape [m, n] = {(m, n)} to match A and B; got {_shape(W_pt)}"
        )
    alpha, beta = _check_scales(alpha, beta, r)
    W_pt, A, B = _f64(W_pt, A, B)
    return W_pt + (A * (1.0 - alpha * beta)) @ B.T, A * alpha, B * beta


def _check_moments(named, r_axes) -> int:
    """named: (name, first moment, name, second moment) per parameter; r_axes: the rank
    axis of each. Every moment is 2-D, the second shaped like the first, one common rank."""
    ranks = []
    for (n1, m1, n2, m2), ax in zip(named, r_axes):
        for name, t in ((n1, m1), (n2, m2)):
            if np.ndim(t) != 2:
                raise ValueError(f"{name} must be 2-D; got shape {_shape(t)}")
        if _shape(m2) != _shape(m1):
            raise ValueError(f"{n2} must have the shape {_shape(m1)} of {n1}; got {_shape(m2)}")
        ranks.append((n1, _shape(m1), _shape(m1)[ax]))
    (n0, s0, r), *rest = ranks
    for n1, s1, r1 in rest:
        if r1 != r:
            raise ValueError(f"rank mismatch: {n0} {s0} has rank {r} but {n1} {s1} has rank {r1}")
    return r


def transfer_adam_moments(exp_avg_A, exp_avg_sq_A, exp_avg_B, exp_avg_sq_B, alpha, beta):
    """AdamW state for (Ã, B̃) = (A diag(α), B diag(β)) from the state of (A, B).

    Moments transform as the gradients do (∇_Ã = ∇_A diag(β), ∇_B̃ = ∇_B diag(α)):
    returns ``(m_A·β, v_A·β², m_B·α, v_B·α²)`` scaled per column; the step count is kept.
    exp_avg_A, exp_avg_sq_A [m, r]; exp_avg_B, exp_avg_sq_B [n, r]; alpha, beta [r].
    """
    r = _check_moments(
        (
            ("exp_avg_A", exp_avg_A, "exp_avg_sq_A", exp_avg_sq_A),
            ("exp_avg_B", exp_avg_B, "exp_avg_sq_B", exp_avg_sq_B),
        ),
        (1, 1),
    )
    alpha, beta = _check_scales(alpha, beta, r)
    mA, vA, mB, vB = _f64(exp_avg_A, exp_avg_sq_A, exp_avg_B, exp_avg_sq_B)
    return mA * beta, vA * beta**2, mB * alpha, vB * alpha**2


# ---- project (PyTorch) layout -------------------------------------------------------------


def _check_torch(lora_A, lora_B, grad_lora_A=None, grad_lora_B=None, W=None):
    if W is None:
        if np.ndim(lora_A) != 2 or np.ndim(lora_B) != 2:
            raise ValueError(
                f"lora_A [r, d_in] and lora_B [d_out, r] must be 2-D; got lora_A "
                f"{_shape(lora_A)}, lora_B {_shape(lora_B)}"
            )
        W = np.empty((_shape(lora_B)[0], _shape(lora_A)[1]))
    check_adapter(W, lora_A, lora_B)
    for name, g, like in (
        ("grad_lora_A", grad_lora_A, lora_A),
        ("grad_lora_B", grad_lora_B, lora_B),
    ):
        if g is not None and _shape(g) != _shape(like):
            raise ValueError(
                f"{name} must have the shape {_shape(like)} of its parameter; got {_shape(g)}"
            )


def to_paper_layout(lora_A, lora_B, scaling) -> tuple[np.ndarray, np.ndarray]:
    """(lora_A [r, d_in], lora_B [d_out, r], s) → (A, B) = (√s·lora_B, √s·lora_Aᵀ)."""
    _check_torch(lora_A, lora_B)
    c = math.sqrt(_positive("scaling", scaling))
    lora_A, lora_B = _f64(lora_A, lora_B)
    return c * lora_B, c * lora_A.T


def grads_to_paper_layout(grad_lora_A, grad_lora_B, scaling) -> tuple[np.ndarray, np.ndarray]:
    """(∇_{lora_A}, ∇_{lora_B}, s) → (∇_A, ∇_B) = (∇_{lora_B}/√s, ∇_{lora_A}ᵀ/√s)."""
    _check_torch(grad_lora_A, grad_lora_B)
    c = math.sqrt(_positive("scaling", scaling))
    gA, gB = _f64(grad_lora_A, grad_lora_B)
    return gB / c, gA.T / c


def scalora_step_torch(
    W, lora_A, lora_B, grad_lora_A, grad_lora_B, scaling, lr_times_L, *, tol: float = 1e-12
):
    """ScaLoRA's rescale-and-merge in project layout.

    W [d_out, d_in] (frozen base), lora_A [r, d_in], lora_B [d_out, r], their gradients,
    s = scaling > 0, lr_times_L = η·L with η the step size on lora_A/lora_B (the paper's
    Lη is then s·η·L). Returns ``(W_new, lora_A_new, lora_B_new, ScaLoRAScaling)`` with

        W_new = W + s·lora_B diag(1 − α⊙β) lora_A,  lora_B_new = lora_B diag(α),
        lora_A_new = diag(β) lora_A

    so W_new + s·lora_B_new·lora_A_new = W + s·lora_B·lora_A.
    """
    _check_torch(lora_A, lora_B, grad_lora_A, grad_lora_B, W)
    s = _positive("scaling", scaling)
    A, B = to_paper_layout(lora_A, lora_B, s)
    gA, gB = grads_to_paper_layout(grad_lora_A, grad_lora_B, s)
    res = scalora_scaling(A, B, gA, gB, s * _positive("lr_times_L", lr_times_L), tol=tol)
    W, lora_A, lora_B = _f64(W, lora_A, lora_B)
    W_new = W + s * (lora_B * (1.0 - res.alpha * res.beta)) @ lora_A
    return W_new, res.beta[:, None] * lora_A, lora_B * res.alpha, res


def transfer_adam_moments_torch(
    exp_avg_lora_A, exp_avg_sq_lora_A, exp_avg_lora_B, exp_avg_sq_lora_B, alpha, beta
):
    """``transfer_adam_moments`` in project layout: lora_A's state [r, d_in] is scaled per
    row by α (α²), lora_B's state [d_out, r] per column by β (β²). Returns the four states
    in the order given."""
    r = _check_moments(
        (
            ("exp_avg_lora_A", exp_avg_lora_A, "exp_avg_sq_lora_A", exp_avg_sq_lora_A),
            ("exp_avg_lora_B", exp_avg_lora_B, "exp_avg_sq_lora_B", exp_avg_sq_lora_B),
        ),
        (0, 1),
    )
    alpha, beta = _check_scales(alpha, beta, r)
    mA, vA, mB, vB = _f64(exp_avg_lora_A, exp_avg_sq_lora_A, exp_avg_lora_B, exp_avg_sq_lora_B)
    return mA * alpha[:, None], vA * (alpha**2)[:, None], mB * beta, vB * beta**2
