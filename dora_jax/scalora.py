"""ScaLoRA for dora_jax: optimally scaled LoRA columns, merged into the frozen kernel.

Zhang, Yang, Cai, Giannakis, arXiv 2510.23818. The float64 reference, the derivations and the
paper-to-project mapping are in ``shared_spec/scalora.py``; this module is the same step in
Flax layout, as jit-able pure functions over pytrees plus a helper for nnx models.

Flax layout (transpose of the project layout): kernel K [d_in, d_out], lora_a [d_in, r],
lora_b [r, d_out], layer function K + s·a·b. The paper's factors are A = √s·lora_bᵀ [d_out, r]
and B = √s·lora_a [d_in, r]; its Lη is ``scaling · lr_times_L`` (lr_times_L = η·L with η the
step size on lora_a / lora_b). Given the scales α, β [r] of Theorem 5 / Theorem 3, one step is

    K ← K + s·a diag(1 − α⊙β) b,   lora_a ← lora_a diag(β),   lora_b ← diag(α) lora_b
    grad_a ← grad_a diag(α),        grad_b ← diag(β) grad_b        (∇ at the rescaled factors)
    Adam mu, nu of lora_a ← ·α, ·α² per column;  of lora_b ← ·β, ·β² per row

and K + s·a·b is unchanged. The 2r×2r system is built from the factors and their gradients
only (O((d_in + d_out)·r²) per layer; the full gradient of K is never formed); layers of one
rank r and dtype are solved together under ``jax.vmap``; the branch (column / scalar / zero
gradient) is chosen with ``jnp.where``. Codes in ``ScaLoRAScaling``: ``branch`` indexes
BRANCHES, ``scalar_case`` SCALAR_CASES (−1 when not the scalar branch); −1 for both when an
interval step did not apply. Extension of the spec (which raises): a layer whose factors or
gradients are not finite gets α = β = 1 (its step is the identity), branch "nonfinite".

DoRA (``DoraDense``, norm detached or exact): K + s·a·b is unchanged, so the column norm, the
magnitude and g are unchanged; a cached ``base_sq`` = ‖K_:j‖² is recomputed from the new
kernel as stored (what ``cache_base_sq()`` would give, up to summation order); see
``base_sq_after_merge`` for why it is not updated in factored form. A ``frozen_norm`` cache
(the norm of K + s·a·b) stays valid: that matrix is unchanged up to rounding.

Usage (nnx; ``scalora_update_jit`` is the pure form, donating adapters, base, opt_state and
grads, so that a merge allocates nothing but its temporaries)::

    opt = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.LoRAParam)
    diff = nnx.DiffState(0, nnx.LoRAParam)
    grads = nnx.grad(loss_fn, argnums=diff)(model, batch)
    grads, info = scalora_step(model, opt, grads, lr_times_L=lr * L, interval=10)
    opt.update(model, grads)  # the step then continues from the rescaled factors
    # pure: adapters = {name: {"lora_a", "lora_b"}}, base = {name: kernel}, opt_state from
    # optax.adamw(lr).init(adapters); the old adapters/base/opt_state/grads are donated:
    adapters, base, opt_state, grads, info = scalora_update_jit(
        adapters, base, opt_state, grads, step, lr_times_L=lr * L, scaling=s, interval=10)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

from shared_spec import scalora as _spec

from . import config as _config
from .checks import caller_stacklevel, check_adapter
from .config import acc_dtype
from .dense import DoraCache, DoraDense
from .norm import base_sq_norm

BRANCHES = (*_spec.BRANCHES, "nonfinite")
SCALAR_CASES = _spec.SCALAR_CASES
_COLUMN, _SCALAR, _ZERO, _NONFINITE = range(4)
_HI = lax.Precision.HIGHEST
AB = ("lora_a", "lora_b")


class ScaLoRAScaling(NamedTuple):
    """Per-layer result (jnp arrays): alpha, beta [r]; branch, scalar_case: int32 codes into
    BRANCHES / SCALAR_CASES (−1: none; both −1 when an interval step did not apply, with
    α = β = 1 and v = 0); v [2r]: the minimum-norm solution of K v = λ."""

    alpha: jax.Array
    beta: jax.Array
    branch: jax.Array
    v: jax.Array
    scalar_case: jax.Array


def default_tol(dtype) -> float:
    """Relative slack of the branch tests: the spec's 1e-12 in float64, 1e-5 below it."""
    return 1e-12 if jnp.dtype(dtype) == jnp.float64 else 1e-5


# ---- one layer: the system and its solution ------------------------------------------------


def _system(lora_a, lora_b, grad_a, grad_b, scaling):
    """(K [2r, 2r], λ [2r], status) for one layer, in promote(f32, inputs).

    S_A = [A, ∇_A] = [√s·bᵀ, grad_bᵀ/√s], S_B = [∇_B, B] = [grad_a/√s, √s·a]; the gradients
    are divided by their largest entry first (K and λ are both quadratic in G, so v is not
    affected). status: −1 normal, _ZERO (both gradients 0) or _NONFINITE; the arrays are
    zeroed (finite) in those cases.
    """
    dt = acc_dtype(lora_a.dtype, lora_b.dtype, grad_a.dtype, grad_b.dtype)
    a, b, ga, gb = (jnp.asarray(t, dt) for t in (lora_a, lora_b, grad_a, grad_b))
    c = jnp.maximum(jnp.max(jnp.abs(ga)), jnp.max(jnp.abs(gb)))
    finite = jnp.isfinite(c) & jnp.all(jnp.isfinite(a)) & jnp.all(jnp.isfinite(b))
    ok = finite & (c > 0)
    safe_c = jnp.where(ok, c, 1)
    ga, gb = (jnp.where(ok, g / safe_c, 0) for g in (ga, gb))
    a, b = (jnp.where(finite, t, 0) for t in (a, b))
    rs = jnp.sqrt(jnp.asarray(scaling, dt))
    sa_t = jnp.concatenate([rs * b, gb / rs], axis=0)  # S_Aᵀ [2r, d_out]
    sb = jnp.concatenate([ga / rs, rs * a], axis=1)  # S_B [d_in, 2r]
    K = jnp.matmul(sa_t, sa_t.T, precision=_HI) * jnp.matmul(sb.T, sb, precision=_HI)
    lam = jnp.concatenate([jnp.sum(ga * ga, axis=0), jnp.sum(gb * gb, axis=1)]) / rs**2
    status = jnp.where(finite, jnp.where(ok, -1, _ZERO), _NONFINITE).astype(jnp.int32)
    return K, lam, status


def _safe(d):
    return jnp.where(d > 0, d, 1)


def _scalar(K, lam, eL, tol):
    """Theorem 3 from the system (spec ``_scalar_from_system``): (α, β, case code)."""
    r = K.shape[-1] // 2
    p, q = jnp.sum(lam[:r]), jnp.sum(lam[r:])
    x, y, z = jnp.sum(K[:r, :r]), jnp.sum(K[r:, r:]), jnp.sum(K[:r, r:])
    CA, CB, C = p * y - q * z, q * x - p * z, x * y - z * z
    zero = jnp.zeros_like(p)
    both = (
        jnp.sqrt(jnp.maximum(CA, 0) / (eL * _safe(C))),
        jnp.sqrt(jnp.maximum(CB, 0) / (eL * _safe(C))),
    )
    a_only = (jnp.sqrt(p / (eL * _safe(x))), zero)
    b_only = (zero, jnp.sqrt(q / (eL * _safe(y))))
    dx, dy = jnp.sqrt(x), jnp.sqrt(y)
    t = (p * dx + q * dy) / (eL * _safe(x * x + 2 * z * dx * dy + y * y))
    degenerate = (jnp.sqrt(t * dx), jnp.sqrt(t * dy))
    nondeg = C > tol * x * y
    case = jnp.where(
        nondeg, jnp.where((CA >= 0) & (CB >= 0), 2, jnp.where(CA > 0, 0, 1)), 3
    ).astype(jnp.int32)
    pick = [
        jnp.select(
            [case == 0, case == 1, case == 2], [o[i] for o in (a_only, b_only, both)], degenerate[i]
        )
        for i in (0, 1)
    ]
    return pick[0], pick[1], case


def _eigh_implementation():
    """The eigensolver for the 2r × 2r systems. On GPUs JAX picks cuSOLVER's Jacobi
    ``syevjBatched`` for n ≤ 32 (r ≤ 16) and the QR-based batched ``syev`` above; by default
    (``config.SCALORA_EIGH_ON_GPU``) ask for the latter at every size, because the Jacobi
    solver was measured slower for these systems (benchmarks/NOTES.md, session 8).
    Elsewhere: JAX's default."""
    choice = _config.SCALORA_EIGH_ON_GPU
    if choice not in ("qr", "jax"):
        raise ValueError(f"config.SCALORA_EIGH_ON_GPU must be 'qr' or 'jax'; got {choice!r}")
    on_gpu = _config.current_platform() == "gpu"
    return lax.linalg.EighImplementation.QR if on_gpu and choice == "qr" else None


def _solve(K, lam, eL, status, tol):
    """The branch rule of the spec on one system (vmapped over the layers of one rank)."""
    r = K.shape[-1] // 2
    # minimum-norm solution with numpy lstsq's cutoff (K is symmetric PSD: eigh is its SVD)
    U, w = lax.linalg.eigh(K, implementation=_eigh_implementation())
    aw = jnp.abs(w)
    keep = aw > jnp.finfo(K.dtype).eps * (2 * r) * jnp.max(aw)
    inv = jnp.where(keep, 1 / jnp.where(keep, w, 1), 0)
    v = jnp.matmul(U, inv * jnp.matmul(U.T, lam, precision=_HI), precision=_HI)
    column = jnp.all(v >= -tol * jnp.max(v))
    sv = jnp.sqrt(jnp.maximum(v, 0) / eL)
    sa, sb, case = _scalar(K, lam, eL, tol)
    alpha = jnp.where(column, sv[:r], sa)
    beta = jnp.where(column, sv[r:], sb)
    special = status >= 0
    branch = jnp.where(special, status, jnp.where(column, _COLUMN, _SCALAR)).astype(jnp.int32)
    one = jnp.ones_like(alpha)
    return ScaLoRAScaling(
        jnp.where(special, one, alpha),
        jnp.where(special, one, beta),
        branch,
        v,
        jnp.where(branch == _SCALAR, case, -1).astype(jnp.int32),
    )


def scalora_scaling(lora_a, lora_b, grad_a, grad_b, *, lr_times_L, scaling, tol=None):
    """The scales α, β [r] of one layer (Flax layout), as ``shared_spec.scalora_step_torch``.

    lora_a [d_in, r], lora_b [r, d_out] and their gradients; lr_times_L = η·L in project units;
    scaling = s. Returns ``ScaLoRAScaling``. jit- and vmap-able.
    """
    K, lam, status = _system(lora_a, lora_b, grad_a, grad_b, scaling)
    tol = default_tol(K.dtype) if tol is None else tol
    return _solve(K, lam, jnp.asarray(scaling * lr_times_L, K.dtype), status, tol)


# ---- the merge, the moments, the DoRA cache ------------------------------------------------


def merge_scaled(kernel, lora_a, lora_b, alpha, beta, scaling):
    """``(K + s·a diag(1 − α⊙β) b, a diag(β), diag(α) b)`` in Flax layout, each in its
    input's dtype (computed in promote(f32, inputs), rounded once into K's dtype).

    K is rewritten ``config.SCALORA_MERGE_ROWS`` rows at a time in a loop (in place when K is
    donated): the f32 product never exists for more than one block of rows.
    """
    acc = acc_dtype(kernel.dtype, lora_a.dtype, lora_b.dtype, alpha.dtype)
    a, b = lora_a.astype(acc), lora_b.astype(acc)
    al, be = alpha.astype(acc), beta.astype(acc)
    ac = a * (jnp.asarray(scaling, acc) * (1 - al * be))  # s·a·diag(c)

    def merged(k_rows, a_rows):
        delta = jnp.matmul(a_rows, b, precision=_HI)
        return (k_rows.astype(acc) + delta).astype(kernel.dtype)

    d_in = kernel.shape[0]
    rows = min(_config.SCALORA_MERGE_ROWS, d_in)
    n_blocks, tail = divmod(d_in, rows)

    def block(i, k):
        start = i * rows
        k_rows = lax.dynamic_slice_in_dim(k, start, rows, axis=0)
        a_rows = lax.dynamic_slice_in_dim(ac, start, rows, axis=0)
        return lax.dynamic_update_slice_in_dim(k, merged(k_rows, a_rows), start, axis=0)

    k_new = lax.fori_loop(0, n_blocks, block, kernel) if n_blocks > 1 else block(0, kernel)
    if tail:
        start = n_blocks * rows
        k_new = k_new.at[start:].set(merged(k_new[start:], ac[start:]))
    return k_new, (a * be).astype(lora_a.dtype), (al[:, None] * b).astype(lora_b.dtype)


def base_sq_after_merge(base_sq, u, gram, lora_b, c, scaling):
    """‖K'_:j‖² for K' = K + s·a diag(c) b from ‖K_:j‖², U = aᵀK [r, d_out], G = aᵀa [r, r]:

        ‖K'_:j‖² = ‖K_:j‖² + 2s·Σ_k c_k b_kj U_kj + s²·Σ_kl c_k c_l b_kj b_lj G_kl

    (expand the square of K_:j + s·Σ_k a_k c_k b_kj). O(d_out·r²) given U and G; but U costs
    a d_in·d_out·r GEMM, while recomputing ``base_sq_norm`` of the merged kernel costs
    d_in·d_out and is exact for the kernel as stored (rounded to its dtype), so
    ``scalora_update`` recomputes; this form is kept for callers that hold U and G already.
    """
    cb = c[:, None] * lora_b
    return (
        base_sq
        + 2 * scaling * jnp.sum(cb * u, axis=0)
        + scaling**2 * jnp.sum(cb * jnp.matmul(gram, cb, precision=_HI), axis=0)
    )


def _scale(t, f):
    return (t * f.astype(acc_dtype(t.dtype, f.dtype))).astype(t.dtype)


def _transfer_adam(state, scales: Mapping):
    """One ScaleByAdamState: mu, nu of each layer's lora_a per column (α, α²), of its lora_b
    per row (β, β²); other entries and the count unchanged."""
    mu, nu = dict(state.mu), dict(state.nu)
    for key, res in scales.items():
        al, be = res.alpha, res.beta[:, None]
        mu[key] = {**mu[key], "lora_a": _scale(mu[key]["lora_a"], al)}
        mu[key]["lora_b"] = _scale(mu[key]["lora_b"], be)
        nu[key] = {**nu[key], "lora_a": _scale(nu[key]["lora_a"], al * al)}
        nu[key]["lora_b"] = _scale(nu[key]["lora_b"], be * be)
    return state._replace(mu=mu, nu=nu)


def _is_adam(x) -> bool:
    return isinstance(x, optax.ScaleByAdamState)


# ---- the pure step over pytrees ------------------------------------------------------------


def _per_layer(x, key):
    return x[key] if isinstance(x, Mapping) else x


def _kernel_of(entry):
    return entry["kernel"] if isinstance(entry, Mapping) else entry


def _check(adapters, base, grads, opt_state) -> None:
    for key, ad in adapters.items():
        if key not in base or key not in grads:
            raise ValueError(f"layer {key!r} of adapters is missing from base or grads")
        check_adapter(_kernel_of(base[key]), ad["lora_a"], ad["lora_b"])
        for name in ("lora_a", "lora_b"):
            g = grads[key][name]
            if jnp.shape(g) != jnp.shape(ad[name]):
                raise ValueError(
                    f"grads[{key!r}][{name!r}] must have the shape {jnp.shape(ad[name])} of "
                    f"the parameter; got {jnp.shape(g)}"
                )
    for st in jax.tree.leaves(opt_state, is_leaf=_is_adam):
        if _is_adam(st):
            for part in ("mu", "nu"):
                tree = getattr(st, part)
                if not isinstance(tree, dict) or not all(k in tree for k in adapters):
                    raise ValueError(
                        f"ScaleByAdamState.{part} must be a dict holding every layer of "
                        "adapters (optax.adamw(...).init(adapters) gives one)"
                    )


def _apply(adapters, base, opt_state, grads, lr_times_L, scaling, tol):
    systems = {}
    for key, ad in adapters.items():
        g = grads[key]
        s = _per_layer(scaling, key)
        systems[key] = (*_system(ad["lora_a"], ad["lora_b"], g["lora_a"], g["lora_b"], s), s)
    groups: dict[tuple, list] = {}
    for key, (K, *_rest) in systems.items():
        groups.setdefault((K.shape[0], K.dtype), []).append(key)
    scales = {}
    for (_, dt), keys in groups.items():
        K, lam, status = (jnp.stack([systems[k][i] for k in keys]) for i in range(3))
        eL = jnp.stack([jnp.asarray(systems[k][3] * _per_layer(lr_times_L, k), dt) for k in keys])
        t = default_tol(dt) if tol is None else tol
        out = jax.vmap(lambda *xs, t=t: _solve(*xs, t))(K, lam, eL, status)
        for i, k in enumerate(keys):
            scales[k] = jax.tree.map(lambda x, i=i: x[i], out)

    new_adapters, new_base, new_grads = dict(adapters), dict(base), dict(grads)
    for key, res in scales.items():
        s = systems[key][3]
        entry = base[key]
        kernel, a, b = merge_scaled(
            _kernel_of(entry),
            adapters[key]["lora_a"],
            adapters[key]["lora_b"],
            res.alpha,
            res.beta,
            s,
        )
        new_adapters[key] = {**adapters[key], "lora_a": a, "lora_b": b}
        if isinstance(entry, Mapping):
            new_entry = {**entry, "kernel": kernel}
            if entry.get("base_sq") is not None:
                new_entry["base_sq"] = base_sq_norm(kernel).astype(entry["base_sq"].dtype)
            new_base[key] = new_entry
        else:
            new_base[key] = kernel
        g = grads[key]
        new_grads[key] = {
            **g,
            "lora_a": _scale(g["lora_a"], res.alpha),
            "lora_b": _scale(g["lora_b"], res.beta[:, None]),
        }
    new_opt = jax.tree.map(
        lambda x: _transfer_adam(x, scales) if _is_adam(x) else x, opt_state, is_leaf=_is_adam
    )
    return new_adapters, new_base, new_opt, new_grads, scales


def _identity(adapters, base, opt_state, grads):
    scales = {}
    for key, ad in adapters.items():
        g = grads[key]
        dt = acc_dtype(ad["lora_a"].dtype, ad["lora_b"].dtype, g["lora_a"].dtype, g["lora_b"].dtype)
        r = ad["lora_a"].shape[1]
        none = jnp.asarray(-1, jnp.int32)
        scales[key] = ScaLoRAScaling(
            jnp.ones(r, dt), jnp.ones(r, dt), none, jnp.zeros(2 * r, dt), none
        )
    return dict(adapters), dict(base), opt_state, dict(grads), scales


def _check_positive(name, value):
    for k, v in value.items() if isinstance(value, Mapping) else [(None, value)]:
        if isinstance(v, jax.core.Tracer):
            continue
        x = float(v)
        if not (math.isfinite(x) and x > 0):
            where = "" if k is None else f"[{k!r}]"
            raise ValueError(f"{name}{where} must be a positive finite number; got {v!r}")


def scalora_update(
    adapters: dict,
    base: dict,
    opt_state: Any,
    grads: dict,
    step=None,
    *,
    lr_times_L,
    scaling,
    interval: int = 1,
    tol: float | None = None,
):
    """One ScaLoRA rescale-and-merge over every layer; pure and jit-able.

    Args:
      adapters: ``{name: {"lora_a": [d_in, r], "lora_b": [r, d_out], ...}}`` (other entries,
        e.g. a DoRA magnitude, pass through unchanged).
      base: ``{name: kernel [d_in, d_out]}`` or ``{name: {"kernel": K, "base_sq": [d_out]}}``
        (a cached ‖K_:j‖², recomputed from the merged kernel; may be absent).
      opt_state: any optax state (or None). In each ``ScaleByAdamState`` (adam, adamw, nadam),
        ``mu`` and ``nu`` must be dicts holding every layer of ``adapters`` (the state of
        ``optax.adamw(...).init(adapters)``); those entries are transferred, the rest of the
        state (count, other transforms) is returned unchanged.
      grads: the gradients of ``adapters``' entries at the current weights (same layout).
      step: the iteration count (int or traced scalar) for ScaLoRA-I: the update applies iff
        ``step % interval == 0`` (``lax.cond``), else everything is returned unchanged.
        None: always apply. On GPUs the ``lax.cond`` blocks the host at every call and
        warns (a RuntimeWarning): choose merge steps on the host where you can.
      lr_times_L: η·L > 0 in project units (η the step size on lora_a, lora_b; the paper's
        Lη is s·η·L); a number or ``{name: number}``.
      scaling: s > 0, a number or ``{name: number}`` (``DoraDense.scaling``; 1 for nnx.LoRA).
      interval: I ≥ 1 (a Python int). tol: slack of the branch tests (``default_tol``).

    Returns ``(adapters, base, opt_state, grads, info)``: grads are the gradients at the
    rescaled factors (feed them to the optimizer step that follows); info is
    ``{"applied": bool, "layers": {name: ScaLoRAScaling}}``. Jitted: ``scalora_update_jit``
    donates ``adapters``, ``base``, ``opt_state`` and ``grads`` (do not reuse those inputs
    afterwards): every output then reuses an input's buffer.
    """
    if not isinstance(interval, int) or interval < 1:
        raise ValueError(f"interval must be a Python int ≥ 1; got {interval!r}")
    _check(adapters, base, grads, opt_state)
    _check_positive("lr_times_L", lr_times_L)
    _check_positive("scaling", scaling)

    def run(operands):
        return _apply(*operands, lr_times_L, scaling, tol)

    def skip(operands):
        return _identity(*operands)

    operands = (adapters, base, opt_state, grads)
    if step is None or interval == 1:
        applied = jnp.asarray(True)
        out = run(operands)
    else:
        if _config.current_platform() == "gpu":
            warnings.warn(
                f"ScaLoRA-I (interval={interval}) decided on the device: XLA on GPUs runs the "
                "lax.cond by blocking the host until the GPU has caught up, at every step "
                "(+25% per step measured on an H200). Choose merge steps on the host: "
                "scalora_step(..., step=<Python int>) or a static flag of your jitted step "
                "(README, ScaLoRA)",
                RuntimeWarning,
                stacklevel=caller_stacklevel(),
            )
        applied = jnp.asarray(step) % interval == 0
        out = lax.cond(applied, run, skip, operands)
    *trees, scales = out
    return (*trees, {"applied": applied, "layers": scales})


scalora_update_jit = jax.jit(
    scalora_update,
    donate_argnames=("adapters", "base", "opt_state", "grads"),
    static_argnames=("interval", "tol"),
)
_scalora_update_nodonate = jax.jit(scalora_update, static_argnames=("interval", "tol"))


# ---- nnx models ----------------------------------------------------------------------------


class LayerRef(NamedTuple):
    """The Variables of one adapted layer: lora_a, lora_b, kernel, the DoRA base_sq cache
    (None if absent) and the scale s."""

    lora_a: nnx.Variable
    lora_b: nnx.Variable
    kernel: nnx.Variable
    base_sq: nnx.Variable | None
    scaling: float


def find_layers(model) -> dict[str, LayerRef]:
    """The ScaLoRA-able layers of an nnx model, by "/"-joined path: ``DoraDense`` (unmerged),
    ``nnx.LoRALinear`` and ``nnx.LoRA`` over an ``nnx.Linear`` (s = 1 for both flax layers).

    A standalone ``nnx.LoRA`` (no base module) has no kernel to merge into and raises.
    """
    return _layers_of(nnx.iter_modules(model))


def _scan(model) -> tuple[dict[str, LayerRef], dict[int, tuple]]:
    """``find_layers(model)`` and the path of every Variable (by id), from one walk of the
    graph: the walks were about half of ``scalora_step``'s host time (benchmarks/NOTES.md,
    session 12)."""
    modules, paths = [], {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable):
            paths.setdefault(id(node), path)
        elif isinstance(node, nnx.Module):
            modules.append((path, node))
    return _layers_of(modules), paths


def _layers_of(modules) -> dict[str, LayerRef]:
    layers, loras, inner = {}, {}, set()
    for path, mod in modules:
        key = "/".join(map(str, path))
        if isinstance(mod, DoraDense):
            if mod.merged:
                raise ValueError(f"DoraDense at {key!r} is merged; call unmerge() first")
            base_sq = mod.base_sq if isinstance(mod.base_sq, DoraCache) else None
            layers[key] = LayerRef(mod.lora_a, mod.lora_b, mod.kernel, base_sq, mod.scaling)
        elif isinstance(mod, nnx.LoRALinear):
            layers[key] = LayerRef(mod.lora.lora_a, mod.lora.lora_b, mod.kernel, None, 1.0)
            inner.add(id(mod.lora))
        elif isinstance(mod, nnx.LoRA):
            loras[key] = mod
    for key, mod in loras.items():
        if id(mod) in inner:
            continue
        if not isinstance(mod.base_module, nnx.Linear):
            raise ValueError(
                f"nnx.LoRA at {key!r} has base_module {type(mod.base_module).__name__}; "
                "ScaLoRA needs an nnx.Linear kernel to merge into"
            )
        layers[key] = LayerRef(mod.lora_a, mod.lora_b, mod.base_module.kernel, None, 1.0)
    return layers


def _flat(state) -> dict:
    return dict(nnx.to_flat_state(state))


def _val(x):
    return x.get_value() if isinstance(x, nnx.Variable) else x


def scalora_step(
    model,
    optimizer: nnx.Optimizer | None,
    grads,
    *,
    lr_times_L,
    step=None,
    interval: int = 1,
    tol: float | None = None,
    donate: bool = True,
):
    """``scalora_update`` on every layer of ``find_layers(model)``, in place.

    model: an nnx model; optimizer: its ``nnx.Optimizer`` (Adam moments in its opt_state are
    transferred; None: no optimizer state); grads: the ``nnx.State`` of gradients from
    ``nnx.grad`` (holding every layer's lora_a and lora_b, as Variables or arrays). step: default
    ``optimizer.step`` (the number of updates done) when interval > 1.

    Writes kernels, adapters, DoRA base_sq caches and moments back into the model and the
    optimizer; returns ``(new_grads, info)`` with new_grads a copy of ``grads`` holding the
    gradients at the rescaled factors (pass them to ``optimizer.update``). With ``donate`` the
    old arrays of those Variables are donated (stale copies, e.g. from an earlier
    ``nnx.state``, become invalid), and so are the layers' lora_a and lora_b arrays in
    ``grads`` (use new_grads; ``donate=False`` leaves ``grads`` as it was); kernels shared by
    two layers are not supported.

    ScaLoRA-I: pass ``step`` as a Python int (a counter of your loop) and steps that do not
    merge return at once, with no device work and no host work beyond this check:
    ``(grads, {"applied": False, "layers": {}})``; steps that merge run the update without
    a ``lax.cond`` (nothing is left to decide on the device; one branch compiled, and 2% less
    temp memory in a CPU compile of a 4-layer case). With the default
    ``step`` (the optimizer's counter, a device array) every call runs the jitted update,
    which skips on the device.

    Each call walks the model's graph on the host (tens of ms for an 8-layer Llama with
    ~1000 Variables), as ``nnx.jit`` does on every call. Where the host limits the step, put
    the whole step (``nnx.grad``, this function with the default ``step``, the optimizer
    update) under one ``nnx.jit(..., donate_argnums=...)`` that donates the model and the
    optimizer: it traces once, and a test checks that it equals the dispatched calls. (The
    inner donation does nothing inside an outer jit: without the outer one, the jitted step
    holds the old and the merged kernels at once.) For ScaLoRA-I in one jit, let the host
    choose: a static ``merge`` argument of the jitted step that calls this function (with
    the default interval) only when true compiles two programs, and steps between merges
    run LoRA's own program. The default ``step`` with ``interval > 1`` instead branches on
    the device (``lax.cond``): XLA's GPU runtime copies the predicate to the host and blocks
    the host until the GPU has caught up, mid-step (+25% per step at r = 8;
    benchmarks/README.md, "ScaLoRA's cost, JAX"), and a RuntimeWarning says so on GPUs.
    """
    host_step = isinstance(interval, int) and interval > 1 and type(step) is int
    if host_step and step % interval:
        return grads, {"applied": False, "layers": {}}
    if host_step:  # this step merges: the update itself, no lax.cond around it
        step, interval = None, 1
    layers, paths = _scan(model)
    if not layers:
        raise ValueError("model has no DoraDense, nnx.LoRALinear or nnx.LoRA(base_module) layer")
    if step is None and interval > 1:
        if optimizer is None:
            raise ValueError("step is required when interval > 1 and no optimizer is given")
        step = optimizer.step.get_value()
    gflat = _flat(grads)

    def grad_of(var, key):
        path = paths[id(var)]
        if path not in gflat:
            raise ValueError(f"grads has no entry {path} for layer {key!r}")
        return path, _val(gflat[path])

    adapters, base, g_in, scales, gpaths = {}, {}, {}, {}, {}
    for key, lr in layers.items():
        adapters[key] = {"lora_a": lr.lora_a.get_value(), "lora_b": lr.lora_b.get_value()}
        entry = {"kernel": lr.kernel.get_value()}
        if lr.base_sq is not None:
            entry["base_sq"] = lr.base_sq.get_value()
        base[key] = entry
        (pa, ga), (pb, gb) = grad_of(lr.lora_a, key), grad_of(lr.lora_b, key)
        g_in[key] = {"lora_a": ga, "lora_b": gb}
        gpaths[key] = (pa, pb)
        scales[key] = lr.scaling

    adam_vars, opt_in = [], []
    if optimizer is not None:
        for st in jax.tree.leaves(optimizer.opt_state, is_leaf=_is_adam):
            if not _is_adam(st):
                continue
            flats = {part: _flat(getattr(st, part)) for part in ("mu", "nu")}
            vars_, vals = {}, {"mu": {}, "nu": {}}
            for part, flat in flats.items():
                for key, (pa, pb) in gpaths.items():
                    if pa not in flat or pb not in flat:
                        raise ValueError(f"the optimizer state has no moments for layer {key!r}")
                    vars_[part, key] = (flat[pa], flat[pb])
                    vals[part][key] = {"lora_a": _val(flat[pa]), "lora_b": _val(flat[pb])}
            adam_vars.append(vars_)
            # count=None: the count is unchanged, and must not be donated
            opt_in.append(optax.ScaleByAdamState(None, vals["mu"], vals["nu"]))

    _check_positive("lr_times_L", lr_times_L)
    fn = scalora_update_jit if donate else _scalora_update_nodonate
    adapters, base, opt_out, g_out, info = fn(
        adapters,
        base,
        tuple(opt_in),
        g_in,
        step,
        lr_times_L=lr_times_L,
        scaling=scales,
        interval=interval,
        tol=tol,
    )

    for key, lr in layers.items():
        lr.lora_a.set_value(adapters[key]["lora_a"])
        lr.lora_b.set_value(adapters[key]["lora_b"])
        lr.kernel.set_value(base[key]["kernel"])
        if lr.base_sq is not None:
            lr.base_sq.set_value(base[key]["base_sq"])
    for vars_, st in zip(adam_vars, opt_out):
        for (part, key), (va, vb) in vars_.items():
            va.set_value(getattr(st, part)[key]["lora_a"])
            vb.set_value(getattr(st, part)[key]["lora_b"])

    new = {p: g_out[key][name] for key, ps in gpaths.items() for p, name in zip(ps, AB)}

    def put(path, x):
        if isinstance(x, nnx.Variable):  # a new Variable (the old one is left as it was)
            return x.replace(new[path] if path in new else x.get_value())
        return new.get(path, x)

    new_grads = nnx.from_flat_state([(p, put(p, x)) for p, x in nnx.to_flat_state(grads)])
    return new_grads, info
