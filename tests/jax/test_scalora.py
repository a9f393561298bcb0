"""dora_jax.scalora against the float64 spec (shared_spec/scalora.py), in Flax layout.

x64 is switched on only inside the tests that need it (the ``x64`` fixture).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shared_spec as S
from dora_jax import DoraDense, base_sq_norm
from dora_jax import scalora as SC
from shared_spec import scalora as SS

F64 = jnp.float64
ETA_L = 0.75  # lr_times_L in project units


def _close(actual, ref, tol=1e-10):
    a, r = np.asarray(actual, np.float64), np.asarray(ref, np.float64)
    assert a.shape == r.shape
    assert np.linalg.norm(a - r) <= tol * max(np.linalg.norm(r), 1.0), (a, r)


def _copy(tree):
    """numpy copies (np.asarray would keep a view of the buffer and block its donation)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def _torch_problem(seed, d_out, d_in, r):
    """Project layout: W, lora_A, lora_B and their gradients for a random G_W (rank 1 for
    every fourth seed)."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((d_out, d_in))
    lA, lB = rng.standard_normal((r, d_in)), rng.standard_normal((d_out, r))
    k = 1 if seed % 4 == 3 else d_in
    G = rng.standard_normal((d_out, k)) @ rng.standard_normal((k, d_in))
    return W, lA, lB, S_ * lB.T @ G, S_ * G @ lA.T  # ∇lora_A, ∇lora_B


S_ = 1.7  # the adapter scale s of the sweep


def _flax(W, lA, lB, gA, gB):
    """Project layout → Flax layout, parameters then gradients."""
    k, a, b = S.to_flax_layout(W, lA, lB)
    return k, a, b, gA.T, gB.T


def _one_layer(k, a, b, ga, gb):
    res = SC.scalora_scaling(a, b, ga, gb, lr_times_L=ETA_L, scaling=S_)
    return res, SC.merge_scaled(k, a, b, res.alpha, res.beta, S_)


def test_scales_and_merge_match_the_spec(x64):
    """Random layers of ranks 1 and 3 (a batch per rank under vmap) vs scalora_step_torch."""
    branches = set()
    for r in (1, 3):
        probs = [_torch_problem(seed, 5, 4, r) for seed in range(12)]
        flax = [_flax(*p) for p in probs]
        batch = [jnp.asarray(np.stack(t)) for t in zip(*flax)]
        res, (k_new, a_new, b_new) = jax.jit(jax.vmap(_one_layer))(*batch)
        for i, (W, lA, lB, gA, gB) in enumerate(probs):
            W_new, lA_new, lB_new, ref = SS.scalora_step_torch(W, lA, lB, gA, gB, S_, ETA_L)
            branches.add(ref.branch)
            assert SC.BRANCHES[int(res.branch[i])] == ref.branch
            case = int(res.scalar_case[i])
            assert (None if case < 0 else SC.SCALAR_CASES[case]) == ref.scalar_case
            _close(res.alpha[i], ref.alpha)
            _close(res.beta[i], ref.beta)
            _close(res.v[i], ref.v)
            for got, want in zip((k_new, a_new, b_new), S.to_flax_layout(W_new, lA_new, lB_new)):
                _close(got[i], want, 1e-12)
    assert branches == {"column", "scalar"}


def test_update_with_adamw_state_matches_the_spec(x64):
    """scalora_update over layers of several shapes and ranks (grouped per rank) and an optax
    adamw state equals the per-layer spec: merge, rescale, gradients ∇lora_a·diag(α),
    diag(β)·∇lora_b, moments; and the next AdamW step (ε = 0) moves the rescaled factors
    exactly as it would have moved the old ones."""
    shapes = {"a": (5, 4, 2), "b": (3, 6, 2), "c": (4, 4, 1)}
    adapters, base, grads, refs = {}, {}, {}, {}
    for i, (key, sh) in enumerate(shapes.items()):
        p = _torch_problem(i, *sh)
        k, a, b, ga, gb = (jnp.asarray(t) for t in _flax(*p))
        adapters[key], base[key], grads[key] = (
            {"lora_a": a, "lora_b": b},
            k,
            {"lora_a": ga, "lora_b": gb},
        )
        refs[key] = SS.scalora_step_torch(*p, S_, ETA_L)
    tx = optax.adamw(1e-2, eps=0.0, weight_decay=0.0)
    tx_update = jax.jit(tx.update)
    _, state = tx_update(jax.tree.map(lambda g: 0.5 * g, grads), tx.init(adapters), adapters)
    new_ad, new_base, new_state, new_grads, info = jax.jit(SC.scalora_update)(
        adapters, base, state, grads, lr_times_L=ETA_L, scaling={k: S_ for k in shapes}
    )
    old, new = state[0], new_state[0]
    assert int(new.count) == int(old.count) == 1
    for key, (W_new, lA_new, lB_new, ref) in refs.items():
        res = info["layers"][key]
        assert SC.BRANCHES[int(res.branch)] == ref.branch
        _close(res.alpha, ref.alpha)
        _close(res.beta, ref.beta)
        k, a, b = S.to_flax_layout(W_new, lA_new, lB_new)
        _close(new_base[key], k, 1e-12)
        _close(new_ad[key]["lora_a"], a, 1e-12)
        _close(new_ad[key]["lora_b"], b, 1e-12)
        _close(new_grads[key]["lora_a"], grads[key]["lora_a"] * ref.alpha, 1e-12)
        _close(new_grads[key]["lora_b"], ref.beta[:, None] * grads[key]["lora_b"], 1e-12)
        moments = [np.asarray(t[key][n]).T for n in ("lora_a", "lora_b") for t in (old.mu, old.nu)]
        want = SS.transfer_adam_moments_torch(*moments, ref.alpha, ref.beta)
        got = [t[key][n] for n in ("lora_a", "lora_b") for t in (new.mu, new.nu)]
        for g, w in zip(got, want):
            _close(g, w.T, 1e-12)
        assert np.all(ref.alpha > 0) and np.all(ref.beta > 0)  # so that ε = 0 is safe below
    upd_old, _ = tx_update(grads, state, adapters)
    upd_new, _ = tx_update(new_grads, new_state, new_ad)
    jax.tree.map(lambda u, v: _close(u, v, 1e-12), upd_old, upd_new)


@pytest.mark.parametrize("name", ["a_only", "b_only", "both", "degenerate", "parallel"])
def test_theorem3_cases_match_the_spec(x64, name):
    rng = np.random.default_rng(3)
    if name in ("a_only", "b_only"):  # the spec tests' example and its mirror
        A = np.array([[0.0, 0.0], [-1.0, -1.0], [-1.0, 0.0]])
        B = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])
        G = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, -1.0, 1.0]])
        if name == "b_only":
            A, B, G = B, A, G.T
    elif name == "both":
        A, B, G = (
            rng.standard_normal((5, 2)),
            rng.standard_normal((4, 2)),
            rng.standard_normal((5, 4)),
        )
    elif name == "degenerate":  # A = 0: ∇_B = 0, C = 0
        A, B, G = np.zeros((4, 2)), rng.standard_normal((3, 2)), rng.standard_normal((4, 3))
    else:  # G = 3abᵀ: M's two terms are parallel
        A, B = np.array([[1.0], [2.0], [0.0]]), np.array([[0.5], [-1.0]])
        G = 3.0 * A @ B.T
    gA, gB = G @ B, G.T @ A
    K, lam = SS.column_system(A, B, *SS._normalized_grads(gA, gB))
    a_ref, b_ref, case = SS._scalar_from_system(K, lam, A.shape[1], ETA_L)
    if name != "parallel":
        assert case == name
    scalar = jax.jit(SC._scalar, static_argnums=3)
    a, b, code = scalar(jnp.asarray(K), jnp.asarray(lam), ETA_L, SC.default_tol(F64))
    assert SC.SCALAR_CASES[int(code)] == case
    _close(a, a_ref, 1e-12)
    _close(b, b_ref, 1e-12)


def test_zero_nonfinite_and_fresh_adapter(x64):
    W, lA, lB, gA, gB = _torch_problem(1, 5, 4, 2)
    z = np.zeros_like
    nan = gA.copy()
    nan[0, 0] = np.nan
    cases = {  # project layout
        "zero_gradient": (W, lA, lB, z(gA), z(gB)),
        "nonfinite": (W, lA, lB, nan, gB),
        "fresh": (W, lA, z(lB), z(gA), gB),  # LoRA init: lora_B = 0, so ∇lora_A = 0
    }
    batch = [jnp.asarray(np.stack(t)) for t in zip(*(_flax(*c) for c in cases.values()))]
    res, (k_new, a_new, b_new) = jax.jit(jax.vmap(_one_layer))(*batch)
    for i, branch in enumerate(("zero_gradient", "nonfinite")):  # the identity
        assert SC.BRANCHES[int(res.branch[i])] == branch
        np.testing.assert_array_equal(res.alpha[i], 1.0)
        np.testing.assert_array_equal(res.beta[i], 1.0)
        np.testing.assert_array_equal(k_new[i], batch[0][i])
        np.testing.assert_array_equal(a_new[i], batch[1][i])
        np.testing.assert_array_equal(b_new[i], batch[2][i])
    ref = SS.scalora_step_torch(*cases["fresh"], S_, ETA_L)[3]
    assert SC.BRANCHES[int(res.branch[2])] == ref.branch == "column"
    _close(res.alpha[2], ref.alpha)
    _close(res.beta[2], ref.beta)
    np.testing.assert_array_equal(k_new[2], batch[0][2])  # lora_b = 0: nothing to merge


# ---- nnx models ----------------------------------------------------------------------------


class _Model(nnx.Module):
    def __init__(self, rngs):
        kw = {"param_dtype": F64}
        self.dora = DoraDense(6, 5, r=3, lora_alpha=6.0, impl="xla", **kw, rngs=rngs)
        self.lora_linear = nnx.LoRALinear(5, 4, lora_rank=2, lora_param_dtype=F64, **kw, rngs=rngs)
        self.lora = nnx.LoRA(
            4, 2, 3, base_module=nnx.Linear(4, 3, **kw, rngs=rngs), **kw, rngs=rngs
        )

    def __call__(self, x):
        return self.lora(jnp.tanh(self.lora_linear(jnp.tanh(self.dora(x)))))


_DIFF = nnx.DiffState(0, nnx.LoRAParam)


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _adam_state(opt):
    (st,) = [s for s in jax.tree.leaves(opt.opt_state, is_leaf=SC._is_adam) if SC._is_adam(s)]
    return st


def _randomize(variables, rng, positive=False):
    for v in variables:
        t = 0.3 * rng.standard_normal(v.get_value().shape)
        v.set_value(jnp.asarray(np.abs(t) if positive else t, v.get_value().dtype))


def test_nnx_model_output_grads_and_moments(x64):
    # built abstractly, then filled with random values (this skips compiling the initializers)
    model = nnx.eval_shape(lambda: _Model(nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    params = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    _randomize([v for v in params if v is not model.dora.magnitude], rng)  # lora_b ≠ 0 too
    _randomize([model.dora.magnitude], rng, positive=True)
    x, y = jnp.asarray(rng.standard_normal((7, 6))), jnp.asarray(rng.standard_normal((7, 3)))
    layers = SC.find_layers(model)
    assert set(layers) == {"dora", "lora_linear", "lora"}
    model.dora.cache_base_sq()
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.LoRAParam)
    st = _adam_state(opt)
    _randomize([v for _, v in nnx.to_flat_state(st.mu)], rng)  # moments of a training run
    _randomize([v for _, v in nnx.to_flat_state(st.nu)], rng, positive=True)
    grad_fn, fwd = nnx.jit(nnx.grad(_loss, argnums=_DIFF)), nnx.jit(lambda m, x: m(x))
    grads = grad_fn(model, x, y)
    before = fwd(model, x)
    old = {  # copies: scalora_step donates the model's arrays
        k: _copy(tuple(v.get_value() for v in (lr.kernel, lr.lora_a, lr.lora_b)))
        for k, lr in layers.items()
    }
    mu_old, nu_old, g_old = (_copy(nnx.as_pure(t)) for t in (st.mu, st.nu, grads))
    donated = model.dora.kernel.get_value()
    old_grads = {p: v.get_value() for p, v in nnx.to_flat_state(grads)}

    new_grads, info = SC.scalora_step(model, opt, grads, lr_times_L=ETA_L)

    assert donated.is_deleted()
    # the layers' adapter gradients are donated too (a merge allocates only temporaries);
    # the magnitude's gradient is no adapter factor: passed through, not donated
    factor = {p: p[-1] in ("lora_a", "lora_b") for p in old_grads}
    assert sum(factor.values()) == 6
    assert all(old_grads[p].is_deleted() == f for p, f in factor.items())
    _close(fwd(model, x), before, 1e-12)  # the merge leaves every layer's function unchanged
    # the returned gradients are the gradients at the rescaled factors
    again = grad_fn(model, x, y)
    for (_, v), (_, w) in zip(nnx.to_flat_state(new_grads), nnx.to_flat_state(again)):
        _close(v.get_value(), w.get_value(), 1e-10)
    st = _adam_state(opt)
    mu, nu = nnx.as_pure(st.mu), nnx.as_pure(st.nu)
    for key, lr in layers.items():
        res = info["layers"][key]
        assert not np.allclose(res.alpha, 1.0)
        sub = lambda t, key=key: t[key]["lora"] if key == "lora_linear" else t[key]  # noqa: E731
        W, lA, lB = S.from_flax_layout(*old[key])
        gA, gB = sub(g_old)["lora_a"].T, sub(g_old)["lora_b"].T
        W_new, lA_new, lB_new, ref = SS.scalora_step_torch(W, lA, lB, gA, gB, lr.scaling, ETA_L)
        _close(res.alpha, ref.alpha)
        _close(res.beta, ref.beta)
        for var, want in zip((lr.kernel, lr.lora_a, lr.lora_b), (W_new, lA_new, lB_new)):
            _close(var.get_value(), want.T, 1e-12)
        moments = [sub(t)[n].T for n in ("lora_a", "lora_b") for t in (mu_old, nu_old)]
        want = SS.transfer_adam_moments_torch(*moments, ref.alpha, ref.beta)
        got = [sub(t)[n] for n in ("lora_a", "lora_b") for t in (mu, nu)]
        for g, w in zip(got, want):
            _close(g, w.T, 1e-12)
    assert int(st.count.get_value()) == 0  # the count is not touched (nor donated)
    # the DoRA base_sq cache: recomputed for the new kernel (as cache_base_sq() would store it)
    k_new = model.dora.kernel.get_value()
    _close(model.dora.base_sq.get_value(), base_sq_norm(k_new), 1e-15)
    assert not np.allclose(base_sq_norm(old["dora"][0]), base_sq_norm(k_new))


def test_base_sq_factored_update_equals_recompute(x64):
    rng = np.random.default_rng(5)
    k, a, b = (jnp.asarray(rng.standard_normal(sh)) for sh in ((7, 5), (7, 3), (3, 5)))
    alpha, beta, s = (
        jnp.asarray(rng.uniform(0.2, 2.0, 3)),
        jnp.asarray(rng.uniform(0.2, 2.0, 3)),
        1.7,
    )
    k_new, _, _ = SC.merge_scaled(k, a, b, alpha, beta, s)
    u, gram = a.T @ k, a.T @ a
    got = SC.base_sq_after_merge(base_sq_norm(k), u, gram, b, 1 - alpha * beta, s)
    _close(got, base_sq_norm(k_new), 1e-12)
    _close(k_new, k + s * (a * (1 - alpha * beta)) @ b, 1e-12)


@pytest.mark.parametrize("rows", [4, 11, 64])
def test_merge_in_row_blocks_is_the_one_product(x64, monkeypatch, rows):
    """d_in = 11 in blocks of 4 (two blocks and a tail of 3), one block, fewer rows than a
    block: each is the unblocked K + s·a diag(1 − α⊙β) b, eagerly and under jit."""
    monkeypatch.setattr(SC._config, "SCALORA_MERGE_ROWS", rows)
    rng = np.random.default_rng(8)
    k, a, b = (jnp.asarray(rng.standard_normal(sh)) for sh in ((11, 5), (11, 3), (3, 5)))
    alpha, beta = (jnp.asarray(rng.uniform(0.2, 2.0, 3)) for _ in range(2))
    ref = k + 1.7 * (a * (1 - alpha * beta)) @ b
    for fn in (SC.merge_scaled, jax.jit(SC.merge_scaled)):
        k_new, a_new, b_new = fn(k, a, b, alpha, beta, 1.7)
        _close(k_new, ref, 1e-14)
        _close(a_new, a * beta, 1e-15)
        _close(b_new, alpha[:, None] * b, 1e-15)


def test_merge_temporaries_do_not_grow_with_the_layer_count(monkeypatch):
    """XLA's compiled temp size of one bf16 merge over 1 and over 6 layers: the f32 product
    exists one block of rows at a time, so six layers need no more than one (before the
    blocked merge each layer held its own f32 [d_in, d_out], 6 × 1.5 MiB here)."""
    monkeypatch.setattr(SC._config, "SCALORA_MERGE_ROWS", 128)
    d_in, d_out, r, bf = 512, 768, 8, jnp.bfloat16
    f32_product = d_in * d_out * 4

    def temp(n_layers):
        spec = jax.ShapeDtypeStruct
        pair = {"lora_a": spec((d_in, r), bf), "lora_b": spec((r, d_out), bf)}
        adapters = {f"l{i}": dict(pair) for i in range(n_layers)}
        base = {f"l{i}": spec((d_in, d_out), bf) for i in range(n_layers)}
        state = jax.eval_shape(optax.adamw(1e-3).init, adapters)
        fn = jax.jit(SC.scalora_update, donate_argnames=("adapters", "base", "opt_state"))
        compiled = fn.lower(adapters, base, state, adapters, lr_times_L=1.0, scaling=2.0).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one, six = temp(1), temp(6)
    assert six - one < f32_product / 2, (one, six)


def test_nnx_rejects_merged_dora_and_bare_lora():
    layer = nnx.eval_shape(lambda: DoraDense(4, 3, r=2, lora_alpha=2.0, rngs=nnx.Rngs(0)))
    layer.merged = True  # as merge() leaves it (find_layers reads only types and flags)
    with pytest.raises(ValueError, match="merged"):
        SC.find_layers(layer)
    with pytest.raises(ValueError, match="base_module"):
        SC.find_layers(nnx.eval_shape(lambda: nnx.LoRA(4, 2, 3, rngs=nnx.Rngs(0))))


# ---- pure form: optax state, jit with donation, interval --------------------------------------


def _pure(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = {"q": (6, 5, 2), "k": (6, 4, 2), "o": (5, 6, 1)}  # (d_in, d_out, r)
    adapters, base, grads = {}, {}, {}
    for key, (d_in, d_out, r) in shapes.items():
        t = lambda *sh: jnp.asarray(rng.standard_normal(sh), dtype)  # noqa: E731
        adapters[key] = {"lora_a": t(d_in, r), "lora_b": t(r, d_out)}
        base[key] = {"kernel": t(d_in, d_out), "base_sq": None}
        grads[key] = {"lora_a": t(d_in, r), "lora_b": t(r, d_out)}
    return adapters, base, grads


def test_jit_donation_and_interval():
    """scalora_update_jit donates its inputs, runs again on its outputs, and with interval=3
    applies the step at steps 0 and 3 only (one trace for every step)."""
    adapters, base, grads = _pure(3)
    state = optax.adamw(1e-3).init(adapters)
    mu, nu = jax.tree.map(lambda g: 0.5 * g, grads), jax.tree.map(jnp.square, grads)
    state = (state[0]._replace(mu=mu, nu=nu), *state[1:])
    traces = SC.scalora_update_jit._cache_size()
    for step in range(5):
        keep = _copy((adapters, base, state, grads))
        donated = (
            adapters["q"]["lora_a"],
            base["q"]["kernel"],
            state[0].mu["q"]["lora_b"],
            grads["q"]["lora_b"],
        )
        adapters, base, state, grads, info = SC.scalora_update_jit(
            adapters, base, state, grads, step, lr_times_L=0.1, scaling=2.0, interval=3
        )
        assert all(x.is_deleted() for x in donated)
        applied = step % 3 == 0
        assert bool(info["applied"]) == applied
        same = jax.tree.map(np.array_equal, keep, (adapters, base, state, grads))
        assert all(jax.tree.leaves(same)) != applied
        codes = [int(r.branch) for r in info["layers"].values()]
        assert all((c >= 0) == applied for c in codes)
    assert SC.scalora_update_jit._cache_size() == traces + 1
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((adapters, base, state)))
    assert base["q"]["kernel"].dtype == jnp.float32 and base["q"]["base_sq"] is None


def test_bad_arguments():
    adapters, base, grads = _pure(4)
    kw = {"lr_times_L": 0.1, "scaling": 1.0}
    with pytest.raises(ValueError, match="interval"):
        SC.scalora_update(adapters, base, None, grads, 0, interval=0, **kw)
    with pytest.raises(ValueError, match="lr_times_L"):
        SC.scalora_update(adapters, base, None, grads, lr_times_L=-1.0, scaling=1.0)
    bad = {**grads, "q": {**grads["q"], "lora_a": grads["q"]["lora_a"][:, :1]}}
    with pytest.raises(ValueError, match="lora_a"):
        SC.scalora_update(adapters, base, None, bad, **kw)
    with pytest.raises(ValueError, match="mu"):
        SC.scalora_update(adapters, base, optax.adam(1e-3).init({"x": grads["q"]}), grads, **kw)


def test_nnx_step_skips_on_the_host_between_merges(x64):
    """ScaLoRA-I with a Python-int step: non-merge steps return at once (nothing donated,
    nothing changed); the merge step applies."""
    model = nnx.eval_shape(lambda: _Model(nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    _randomize([v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)], rng)
    x, y = jnp.asarray(rng.standard_normal((5, 6))), jnp.asarray(rng.standard_normal((5, 3)))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.LoRAParam)
    grads = nnx.jit(nnx.grad(_loss, argnums=_DIFF))(model, x, y)
    kernel = model.dora.kernel.get_value()
    out, info = SC.scalora_step(model, opt, grads, lr_times_L=ETA_L, step=3, interval=10)
    assert out is grads and info == {"applied": False, "layers": {}}
    assert not kernel.is_deleted() and model.dora.kernel.get_value() is kernel
    out, info = SC.scalora_step(model, opt, grads, lr_times_L=ETA_L, step=10, interval=10)
    assert bool(info["applied"]) and set(info["layers"]) == {"dora", "lora_linear", "lora"}
    assert kernel.is_deleted()  # the merge donated the old kernel


@pytest.mark.parametrize("form", ["every_step", "device_counter", "static_flag"])
def test_nnx_step_inside_one_nnx_jit_equals_the_dispatched_step(x64, form):
    """The whole training step (grad, scalora_step, optimizer update) under one ``nnx.jit``
    (what removes scalora_step's per-call host walk of the model) equals the same calls
    dispatched one by one with the loop's counter as a Python int: every step, and ScaLoRA-I
    (I = 2) decided on the device (the optimizer's counter, a ``lax.cond``) or by the host
    (a static ``merge`` flag: two compiled programs, no branch on the device)."""
    interval = 1 if form == "every_step" else 2

    def build():
        model = nnx.eval_shape(lambda: _Model(nnx.Rngs(0)))
        rng = np.random.default_rng(2)
        _randomize([v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)], rng)
        _randomize([model.dora.magnitude], rng, positive=True)
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.LoRAParam)

    def step(model, opt, x, y, merge):
        grads = nnx.grad(_loss, argnums=_DIFF)(model, x, y)
        if form == "static_flag":
            if merge:
                grads, _ = SC.scalora_step(model, opt, grads, lr_times_L=ETA_L)
            applied = jnp.asarray(merge)
        else:
            grads, info = SC.scalora_step(model, opt, grads, lr_times_L=ETA_L, interval=interval)
            applied = info["applied"]
        opt.update(model, grads)
        return applied

    def dispatched(model, opt, x, y, i):
        grads = nnx.jit(nnx.grad(_loss, argnums=_DIFF))(model, x, y)
        grads, info = SC.scalora_step(
            model, opt, grads, lr_times_L=ETA_L, step=i, interval=interval
        )
        nnx.jit(lambda m, o, g: o.update(m, g))(model, opt, grads)
        return bool(info["applied"])

    rng = np.random.default_rng(3)
    x, y = jnp.asarray(rng.standard_normal((5, 6))), jnp.asarray(rng.standard_normal((5, 3)))
    (m1, o1), (m2, o2) = build(), build()
    # Donated as the docs show: the merge then writes the kernels in place (without it the
    # step holds the old and the merged kernels at once).
    jitted = nnx.jit(step, donate_argnums=(0, 1), static_argnames="merge")
    applied = []
    for i in range(3):
        kernel = m1.dora.kernel.get_value()
        applied.append(bool(jitted(m1, o1, x, y, merge=i % interval == 0)))
        assert kernel.is_deleted()
        assert dispatched(m2, o2, x, y, i) == applied[-1]
        for a, b in zip(jax.tree.leaves(nnx.state(m1)), jax.tree.leaves(nnx.state(m2))):
            _close(a, b, 1e-12)
    assert applied == ([True] * 3 if interval == 1 else [True, False, True])
    assert not np.allclose(m1.dora.kernel.get_value(), build()[0].dora.kernel.get_value())


def test_device_decided_interval_warns_on_gpus(monkeypatch):
    """On a GPU, ScaLoRA-I with a traced step (the lax.cond form) warns once per trace and
    names the host-side alternatives, at the caller's line; every-step updates and other
    platforms do not warn. Traced with eval_shape: nothing is lowered for a GPU here."""
    import functools
    import warnings

    from dora_jax import config

    adapters, base, grads = _pure(5)
    kw = {"lr_times_L": 0.1, "scaling": 1.0}

    def trace(step, interval):
        f = functools.partial(SC.scalora_update, interval=interval, **kw)
        return jax.eval_shape(f, adapters, base, None, grads, step)

    monkeypatch.setattr(config, "current_platform", lambda: "gpu")
    with pytest.warns(RuntimeWarning, match=r"interval=4.*step=<Python int>") as got:
        trace(jnp.asarray(3), 4)
    assert got[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace(None, 4)  # every step: no cond
        trace(jnp.asarray(3), 1)
        monkeypatch.setattr(config, "current_platform", lambda: "cpu")
        trace(jnp.asarray(3), 4)


def test_gpu_eigensolver_is_the_batched_qr_one_at_every_rank(monkeypatch):
    """JAX would pick cuSOLVER's Jacobi solver for 2r ≤ 32 on GPUs (the suspected cause of
    the r = 8 every-step cost); the systems ask for the QR-based one there, and for JAX's
    default elsewhere (CPU, where Jacobi does not exist)."""
    from jax import lax

    from dora_jax import config
    from dora_jax import scalora as SC

    monkeypatch.setattr(config, "current_platform", lambda: "gpu")
    assert SC._eigh_implementation() is lax.linalg.EighImplementation.QR
    monkeypatch.setattr(config, "SCALORA_EIGH_ON_GPU", "jax")
    assert SC._eigh_implementation() is None
    monkeypatch.setattr(config, "SCALORA_EIGH_ON_GPU", "jacobi")
    with pytest.raises(ValueError, match="SCALORA_EIGH_ON_GPU"):
        SC._eigh_implementation()
    monkeypatch.setattr(config, "SCALORA_EIGH_ON_GPU", "qr")
    monkeypatch.setattr(config, "current_platform", lambda: "cpu")
    assert SC._eigh_implementation() is None
