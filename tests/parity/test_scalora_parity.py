"""ScaLoRA across frameworks: ``dora_torch.ScaLoRA`` (PyTorch layout) and ``dora_jax.scalora``
(Flax layout) take the same step as each other and as the float64 spec
(``shared_spec/scalora.py``) on the same adapters, gradients and AdamW moments.

Compared, in float64 (torch float64; JAX inside a local x64 context that is restored after
each test): the scales α, β, the branch (and Theorem 3's case), the merged base weight, the
rescaled factors, the rescaled gradients and the transferred AdamW moments. Layouts are
converted only with ``shared_spec.layout``: torch W [d_out, d_in], lora_A [r, d_in],
lora_B [d_out, r]; Flax kernel [d_in, d_out], lora_a [d_in, r], lora_b [r, d_out].

Units. Both APIs take ``lr_times_L`` as L·η in project units (η the step size on the factors);
the paper's Lη is s·lr_times_L (torch reports it as ``ScaLoRAReport.lr_times_L``). The torch
default ``lr_times_L=None`` is an "auto" rule with no JAX counterpart, so every test passes the
same explicit value to both.

Cases: a column-branch layer (Theorem 5, v ≥ 0), a scalar-fallback layer (Theorem 3, v has a
clearly negative entry) and the DoRA variant (``dora_torch.Linear`` vs ``dora_jax.DoraDense``
with the same weights, each with its own autograd gradients: same merge, outputs unchanged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from torch import nn

import dora_torch
from dora_jax import DoraDense
from dora_jax import scalora as JS
from dora_torch import scalora as TS
from shared_spec import scalora as SS
from shared_spec.layout import from_flax_layout, to_flax_layout

F64 = torch.float64
LR_TIMES_L = 0.8  # L·η in project units, the same for both frameworks (paper Lη = s·0.8)
SCALING = 1.5
# (d_out, d_in, r, seed) chosen so the spec takes the named branch on a well-conditioned K
# (the tests assert the branch, so a change in the generator cannot silently swap cases).
CASES = {"column": (8, 6, 3, 1), "scalar": (7, 5, 2, 4)}


def _close(got, want, tol=1e-10, what=""):
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape, (what, g.shape, w.shape)
    err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def _problem(d_out, d_in, r, seed):
    """Project layout: W, lora_A, lora_B, their gradients for loss ⟨G, W_eff⟩ (G random), and
    random AdamW moments (second moments positive)."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((d_out, d_in))
    lA, lB = rng.standard_normal((r, d_in)), rng.standard_normal((d_out, r))
    G = rng.standard_normal((d_out, d_in))
    grads = (SCALING * lB.T @ G, SCALING * G @ lA.T)  # ∇lora_A, ∇lora_B
    moments = (
        0.1 * rng.standard_normal(lA.shape),  # exp_avg of lora_A
        0.01 * rng.uniform(0.1, 1.0, lA.shape),  # exp_avg_sq of lora_A
        0.1 * rng.standard_normal(lB.shape),  # exp_avg of lora_B
        0.01 * rng.uniform(0.1, 1.0, lB.shape),  # exp_avg_sq of lora_B
    )
    return (W, lA, lB), grads, moments


# ---- torch -------------------------------------------------------------------------------


class _LoRA(nn.Module):
    """A plain LoRA layer exposing ``lora_factors()`` (the protocol ScaLoRA discovers)."""

    def __init__(self, W, lA, lB, s):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(W, dtype=F64), requires_grad=False)
        self.lora_A = nn.Parameter(torch.tensor(lA, dtype=F64))
        self.lora_B = nn.Parameter(torch.tensor(lB, dtype=F64))
        self.s = s

    def lora_factors(self):
        return self.weight, self.lora_A, self.lora_B, self.s

    def forward(self, x):
        return x @ self.weight.T + self.s * (x @ self.lora_A.T) @ self.lora_B.T


def _torch_adamw(params, moments):
    """torch AdamW whose state holds the given moments (as after some steps of training)."""
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    for p, (m, v) in zip(params, moments):
        opt.state[p] = {
            "step": torch.tensor(5.0, dtype=F64),
            "exp_avg": torch.tensor(m, dtype=F64),
            "exp_avg_sq": torch.tensor(v, dtype=F64),
        }
    return opt


def _torch_step(module, opt):
    """Run ``ScaLoRA`` with the explicit lr_times_L; return (report, W, A, B, ∇A, ∇B, moments)."""
    report = TS.ScaLoRA(module, opt, lr_times_L=LR_TIMES_L).step()
    assert report.merged and len(report.names) == 1
    # torch reports the paper-unit Lη: s·lr_times_L
    _close(report.lr_times_L[0], SCALING * LR_TIMES_L, 1e-15, "torch Lη (paper units)")
    lA, lB = module.lora_A, module.lora_B
    st = [opt.state[p][k] for p in (lA, lB) for k in ("exp_avg", "exp_avg_sq")]
    return report, _np(module.weight), _np(lA), _np(lB), _np(lA.grad), _np(lB.grad), map(_np, st)


# ---- JAX ---------------------------------------------------------------------------------


def _jax_adamw_state(adapters, key, moments):
    """optax adamw state for ``adapters`` with the given (project-layout) moments of ``key``."""
    tx = optax.adamw(1e-2, weight_decay=0.0)
    state = tx.init(adapters)
    mA, vA, mB, vB = moments
    mu = {key: {"lora_a": jnp.asarray(mA.T), "lora_b": jnp.asarray(mB.T)}}
    nu = {key: {"lora_a": jnp.asarray(vA.T), "lora_b": jnp.asarray(vB.T)}}
    return (state[0]._replace(mu=mu, nu=nu), *state[1:])


# ---- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("branch", list(CASES))
def test_lora_step_torch_jax_and_spec_agree(x64, branch):
    d_out, d_in, r, seed = CASES[branch]
    (W, lA, lB), (gA, gB), moments = _problem(d_out, d_in, r, seed)

    # the spec (project layout)
    W_ref, lA_ref, lB_ref, ref = SS.scalora_step_torch(W, lA, lB, gA, gB, SCALING, LR_TIMES_L)
    assert ref.branch == branch
    if branch == "scalar":
        assert ref.v.min() < -0.1 * ref.v.max()  # clearly negative, not a rounding zero
    else:
        assert ref.v.min() > 0
    # the same α, β from the paper-layout entry point with Lη = s·lr_times_L (units check)
    A, B = SS.to_paper_layout(lA, lB, SCALING)
    pa = SS.scalora_scaling(A, B, *SS.grads_to_paper_layout(gA, gB, SCALING), SCALING * LR_TIMES_L)
    _close(pa.alpha, ref.alpha, 1e-14, "paper-layout alpha")
    _close(pa.beta, ref.beta, 1e-14, "paper-layout beta")
    want_moments = SS.transfer_adam_moments_torch(*moments, ref.alpha, ref.beta)

    # torch: a protocol layer, its gradients set directly, an AdamW with the moments
    layer = _LoRA(W, lA, lB, SCALING)
    layer.lora_A.grad = torch.tensor(gA, dtype=F64)
    layer.lora_B.grad = torch.tensor(gB, dtype=F64)
    opt = _torch_adamw([layer.lora_A, layer.lora_B], [moments[:2], moments[2:]])
    x = torch.tensor(np.random.default_rng(99).standard_normal((4, d_in)), dtype=F64)
    with torch.no_grad():
        y_before = _np(layer(x))
    report, tW, tA, tB, tgA, tgB, t_moms = _torch_step(layer, opt)
    t_moms = list(t_moms)
    assert TS.BRANCHES[int(report.branch[0])] == branch
    if branch == "scalar":
        assert TS.SCALAR_CASES[int(report.scalar_case[0])] == ref.scalar_case
    with torch.no_grad():
        _close(_np(layer(x)), y_before, 1e-13, "torch output after the merge")

    # JAX: the pure update over {layer: ...} in Flax layout, an optax adamw state
    k, a, b = (jnp.asarray(t) for t in to_flax_layout(W, lA, lB))
    adapters = {"l": {"lora_a": a, "lora_b": b}}
    grads = {"l": {"lora_a": jnp.asarray(gA.T), "lora_b": jnp.asarray(gB.T)}}
    state = _jax_adamw_state(adapters, "l", moments)
    new_ad, new_base, new_state, new_grads, info = JS.scalora_update(
        adapters, {"l": k}, state, grads, lr_times_L=LR_TIMES_L, scaling=SCALING
    )
    res = info["layers"]["l"]
    assert res.alpha.dtype == jnp.float64
    assert JS.BRANCHES[int(res.branch)] == branch
    case = int(res.scalar_case)
    assert (None if case < 0 else JS.SCALAR_CASES[case]) == ref.scalar_case
    jW, jA, jB = from_flax_layout(new_base["l"], new_ad["l"]["lora_a"], new_ad["l"]["lora_b"])
    jgA, jgB = np.asarray(new_grads["l"]["lora_a"]).T, np.asarray(new_grads["l"]["lora_b"]).T
    mu, nu = new_state[0].mu["l"], new_state[0].nu["l"]
    j_moms = [np.asarray(t[n]).T for n in ("lora_a", "lora_b") for t in (mu, nu)]
    assert int(new_state[0].count) == int(state[0].count)

    # all three agree: scales, merged base, factors, gradients, moments
    want = {
        "alpha": ref.alpha,
        "beta": ref.beta,
        "W": W_ref,
        "lora_A": lA_ref,
        "lora_B": lB_ref,
        "grad lora_A": ref.alpha[:, None] * gA,  # diag(α)·∇lora_A
        "grad lora_B": gB * ref.beta,  # ∇lora_B·diag(β)
        **{f"moment {i}": m for i, m in enumerate(want_moments)},
    }
    torch_got = [_np(report.alpha[0]), _np(report.beta[0]), tW, tA, tB, tgA, tgB, *t_moms]
    jax_got = [res.alpha, res.beta, jW, jA, jB, jgA, jgB, *j_moms]
    for (name, w), tg, jg in zip(want.items(), torch_got, jax_got):
        _close(tg, w, 1e-10, f"{branch}/{name}: torch vs spec")
        _close(jg, w, 1e-10, f"{branch}/{name}: jax vs spec")
        _close(tg, jg, 1e-10, f"{branch}/{name}: torch vs jax")
    assert not np.allclose(ref.alpha * ref.beta, 1.0)  # the merge moved something into W
    _close(tW + SCALING * tB @ tA, W + SCALING * lB @ lA, 1e-13, "torch W_eff unchanged")
    _close(jW + SCALING * jB @ jA, W + SCALING * lB @ lA, 1e-13, "jax W_eff unchanged")


def test_dora_torch_linear_and_dora_dense_take_the_same_step(x64):
    d_in, d_out, r, lora_alpha = 6, 5, 2, 3.0
    rng = np.random.default_rng(7)
    W = 0.5 * rng.standard_normal((d_out, d_in))
    bias = 0.1 * rng.standard_normal(d_out)
    lA, lB = rng.standard_normal((r, d_in)), 0.5 * rng.standard_normal((d_out, r))
    mag = rng.uniform(0.5, 2.0, d_out)
    x, target = rng.standard_normal((9, d_in)), rng.standard_normal((9, d_out))
    moments = (
        0.1 * rng.standard_normal(lA.shape),
        0.01 * rng.uniform(0.1, 1.0, lA.shape),
        0.1 * rng.standard_normal(lB.shape),
        0.01 * rng.uniform(0.1, 1.0, lB.shape),
    )

    # torch: dora_torch.Linear in float64 with these weights
    tl = dora_torch.Linear(d_in, d_out, r=r, lora_alpha=lora_alpha, dtype=F64, impl="eager")
    with torch.no_grad():
        for p, v in ((tl.weight, W), (tl.bias, bias), (tl.lora_A, lA), (tl.lora_B, lB)):
            p.copy_(torch.tensor(v, dtype=F64))
        tl.lora_magnitude_vector.copy_(torch.tensor(mag, dtype=F64))
    s = tl.scaling
    xt, yt = torch.tensor(x, dtype=F64), torch.tensor(target, dtype=F64)
    y_torch = tl(xt)
    ((y_torch - yt) ** 2).mean().backward()
    y_torch, t_gA, t_gB = _np(y_torch), _np(tl.lora_A.grad), _np(tl.lora_B.grad)
    opt = _torch_adamw([tl.lora_A, tl.lora_B], [moments[:2], moments[2:]])

    # JAX: DoraDense (float64) with the same weights, in Flax layout
    jl = DoraDense(d_in, d_out, r=r, lora_alpha=lora_alpha, param_dtype=jnp.float64,
                   impl="xla", rngs=nnx.Rngs(0))  # fmt: skip
    assert jl.scaling == s
    k, a, b = to_flax_layout(W, lA, lB)
    pairs = ((jl.kernel, k), (jl.bias, bias), (jl.lora_a, a), (jl.lora_b, b), (jl.magnitude, mag))
    for var, v in pairs:
        var.set_value(jnp.asarray(v, jnp.float64))
    xj, yj = jnp.asarray(x), jnp.asarray(target)

    def loss(m):
        return jnp.mean((m(xj) - yj) ** 2)

    grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(jl)
    y_jax = np.asarray(jl(xj))
    _close(y_jax, y_torch, 1e-12, "DoRA outputs, torch vs jax")
    j_gA, j_gB = (
        np.asarray(grads["lora_a"].get_value()).T,
        np.asarray(grads["lora_b"].get_value()).T,
    )
    _close(j_gA, t_gA, 1e-11, "DoRA ∇lora_A, torch vs jax")
    _close(j_gB, t_gB, 1e-11, "DoRA ∇lora_B, torch vs jax")
    jopt = nnx.Optimizer(jl, optax.adamw(1e-2, weight_decay=0.0), wrt=nnx.LoRAParam)
    (st,) = [t for t in jax.tree.leaves(jopt.opt_state, is_leaf=JS._is_adam) if JS._is_adam(t)]
    mA, vA, mB, vB = moments
    for tree, (ta, tb) in ((st.mu, (mA, mB)), (st.nu, (vA, vB))):
        tree["lora_a"].set_value(jnp.asarray(ta.T))
        tree["lora_b"].set_value(jnp.asarray(tb.T))

    # the spec on torch's gradients
    W_ref, lA_ref, lB_ref, ref = SS.scalora_step_torch(W, lA, lB, t_gA, t_gB, s, LR_TIMES_L)
    assert not np.allclose(ref.alpha * ref.beta, 1.0)
    want_moments = SS.transfer_adam_moments_torch(*moments, ref.alpha, ref.beta)

    report, tW, tA, tB, tgA2, tgB2, t_moms = _torch_step(tl, opt)
    new_grads, info = JS.scalora_step(jl, jopt, grads, lr_times_L=LR_TIMES_L, donate=False)
    res = info["layers"][""]  # the layer is the model: its path is ""
    assert TS.BRANCHES[int(report.branch[0])] == JS.BRANCHES[int(res.branch)] == ref.branch
    jW, jA, jB = from_flax_layout(
        jl.kernel.get_value(), jl.lora_a.get_value(), jl.lora_b.get_value()
    )
    (st,) = [t for t in jax.tree.leaves(jopt.opt_state, is_leaf=JS._is_adam) if JS._is_adam(t)]
    j_moms = [np.asarray(t[n].get_value()).T for n in ("lora_a", "lora_b") for t in (st.mu, st.nu)]
    want = {
        "alpha": ref.alpha,
        "beta": ref.beta,
        "W": W_ref,
        "lora_A": lA_ref,
        "lora_B": lB_ref,
        **{f"moment {i}": m for i, m in enumerate(want_moments)},
    }
    torch_got = [_np(report.alpha[0]), _np(report.beta[0]), tW, tA, tB, *t_moms]
    jax_got = [res.alpha, res.beta, jW, jA, jB, *j_moms]
    for (name, w), tg, jg in zip(want.items(), torch_got, jax_got):
        _close(tg, w, 1e-10, f"DoRA/{name}: torch vs spec")
        _close(jg, w, 1e-9, f"DoRA/{name}: jax vs spec")  # jax ran on its own (equal) grads
        _close(tg, jg, 1e-9, f"DoRA/{name}: torch vs jax")
    # rescaled gradients: diag(α)·∇lora_A and ∇lora_B·diag(β), each on its own gradients
    _close(tgA2, ref.alpha[:, None] * t_gA, 1e-10, "torch rescaled ∇lora_A")
    _close(tgB2, t_gB * ref.beta, 1e-10, "torch rescaled ∇lora_B")
    _close(
        np.asarray(new_grads["lora_a"].get_value()).T,
        ref.alpha[:, None] * j_gA,
        1e-9,
        "jax ∇lora_a",
    )
    _close(np.asarray(new_grads["lora_b"].get_value()).T, j_gB * ref.beta, 1e-9, "jax ∇lora_b")
    # the magnitude is untouched and both layers compute what they computed before
    _close(_np(tl.lora_magnitude_vector), mag, 0.0, "torch magnitude")
    _close(jl.magnitude.get_value(), mag, 0.0, "jax magnitude")
    with torch.no_grad():
        y_torch_after = _np(tl(xt))
    _close(y_torch_after, y_torch, 1e-12, "torch DoRA output after the merge")
    _close(np.asarray(jl(xj)), y_jax, 1e-12, "jax DoRA output after the merge")
    _close(y_torch_after, np.asarray(jl(xj)), 1e-12, "DoRA outputs after, torch vs jax")
