"""The one helper that checks a dora_torch tier against the float64 spec: forward and every
gradient (x, A, B, m, bias), with the shared tolerance rule.

Baseline (what 'plain framework code' means here): dense eager torch DoRA in the working
dtype — W + s·B·A built densely, its row norm, composition in that dtype — autograd for the
gradients. The reference is the spec evaluated on the inputs after casting them.
"""

from __future__ import annotations

import numpy as np
import torch

import dora_torch
import shared_spec as S
from shared_spec import cases
from shared_spec.tolerances import assert_close

EPS = S.EPS


def to_torch(d: cases.CaseData, dtype, device="cpu") -> dict:
    def t(a):
        return None if a is None else torch.tensor(a, dtype=dtype, device=device)

    return {
        "x": t(d.x),
        "W": t(d.W),
        "A": t(d.A),
        "B": t(d.B),
        "m": t(d.m),
        "bias": t(d.bias),
        "dy": t(d.dy),
        "s": d.scaling,
    }


def _np(t):
    return None if t is None else t.detach().double().cpu().numpy()


class _Upcast(torch.autograd.Function):
    """``t.float()`` whose backward rounds the fp32 gradient to t's dtype saturating at its
    largest finite value (as dora_torch's backward does with g ⊙ dy) instead of overflowing."""

    @staticmethod
    def forward(ctx, t):
        ctx.dtype = t.dtype
        return t.float()

    @staticmethod
    def backward(ctx, grad):
        big = torch.finfo(ctx.dtype).max
        return grad.clamp(-big, big).to(ctx.dtype)


def dense_baseline(x, W, A, B, m, s, bias=None, *, exact=False, keep=None):
    """Plain dense DoRA in the inputs' dtype (the common implementation). ``keep`` is the
    scaled dropout mask (x_d = keep ⊙ x), giving PEFT's dropout form.

    W + s·B·A and the products run in the inputs' dtype; the row norm (sum of squares, eps
    clamp, sqrt) and g = m / n run in fp32, and g is applied in fp32 before one rounding of y
    to the dtype, as PEFT does (fp32 magnitude, result upcast) and as dora_jax's naive
    baseline keeps the norm. In fp16 the clamp EPS² = 1e-24 would underflow to 0 and
    g = m / max(n, EPS) = 5e11 overflow, so a zero row made this baseline inf/NaN and the
    tolerance bound infinite (the rule now fails on that); the gradient g ⊙ dy is rounded back
    to the dtype saturating (``_Upcast``) for the same reason.
    """
    dt = x.dtype
    sq = (W + s * (B @ A)).float().square().sum(1)
    n = sq.clamp_min(EPS * EPS).sqrt()
    if not exact:
        n = n.detach()
    g = m.float() / n
    if keep is None:
        y = g * _Upcast.apply(x @ W.t() + s * (x @ A.t()) @ B.t())
    else:
        xd = x * keep
        base, base_d = _Upcast.apply(x @ W.t()), _Upcast.apply(xd @ W.t())
        y = base + (g - 1) * base_d + g * _Upcast.apply(s * ((xd @ A.t()) @ B.t()))
    y = y.to(dt)
    return y if bias is None else y + bias


def _run(fn, inputs, grads_of, dy):
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in grads_of}
    args = {**inputs, **leaves}
    y = fn(args)
    y.backward(dy)
    return y.detach(), {k: leaves[k].grad for k in grads_of}


def check_tier(
    case: str | cases.Case,
    dtype: torch.dtype,
    impl: str,
    *,
    exact: bool = False,
    seed: int = 0,
    data: cases.CaseData | None = None,
    device: str = "cpu",
    k: float = 2.0,
    dropout_p: float = 0.0,
    recompute_inner: bool = False,
) -> dict:
    """Assert forward and all gradients of ``dora_linear(impl=...)`` against the spec.

    ``case``: a shared case's name or an ad-hoc ``cases.Case``; ``data`` replaces its draw
    ``case.make(seed)`` (e.g. with some magnitudes zeroed). With ``dropout_p`` the layer runs
    in training mode with adapter dropout; the mask is reproduced from the same RNG seed and
    given to the spec as ``x_dropped``; ``recompute_inner`` is passed to ``dora_linear``.
    Returns {"y" | "dx" | ...: (ours, reference, baseline)}
    as float64 NumPy, for further checks on parts of a result."""
    case = cases.get(case) if isinstance(case, str) else case
    case_name = case.name
    d = case.make(seed) if data is None else data
    t = to_torch(d, dtype, device)
    grads_of = ["x", "A", "B", "m"] + (["bias"] if t["bias"] is not None else [])
    s = t["s"]

    keep = None
    if dropout_p:
        torch.manual_seed(1234)
        x2 = t["x"].reshape(-1, t["x"].shape[-1])
        ones = torch.ones_like(x2)
        keep = torch.nn.functional.dropout(ones, dropout_p, training=True).reshape(t["x"].shape)

    def ours(a):
        torch.manual_seed(1234)
        return dora_torch.dora_linear(
            a["x"],
            a["W"],
            a["A"],
            a["B"],
            a["m"],
            s,
            a["bias"],
            impl=impl,
            exact_norm_grad=exact,
            dropout_p=dropout_p,
            training=bool(dropout_p),
            recompute_inner=recompute_inner,
        )

    def base(a):
        return dense_baseline(
            a["x"], a["W"], a["A"], a["B"], a["m"], s, a["bias"], exact=exact, keep=keep
        )

    y, g = _run(ours, t, grads_of, t["dy"])
    yb, gb = _run(base, t, grads_of, t["dy"])
    c = {name: _np(t[name]) for name in ("x", "W", "A", "B", "m", "bias", "dy")}
    xd = None if keep is None else c["x"] * _np(keep)
    ref_y = S.dora_linear(c["x"], c["W"], c["A"], c["B"], c["m"], s, c["bias"], x_dropped=xd)
    ref = S.dora_linear_vjp(
        c["x"],
        c["W"],
        c["A"],
        c["B"],
        c["m"],
        s,
        c["dy"],
        c["bias"],
        exact_norm_grad=exact,
        x_dropped=xd,
    )
    if keep is not None:  # chain rule through x_d = keep ⊙ x
        ref = ref._replace(dx=ref.dx + ref.dx_dropped * _np(keep))
    eps = torch.finfo(dtype).eps
    big = torch.finfo(dtype).max
    tag = f"{case_name}/{dtype}/{impl}/{'exact' if exact else 'detached'}"
    tag += "/recompute" if recompute_inner else ""
    assert y.dtype == dtype and tuple(y.shape) == tuple(d.dy.shape)
    results = {"y": (_np(y), ref_y, _np(yb))}
    _close(*results["y"], eps, k, f"{tag} y")
    refs = {"x": ref.dx, "A": ref.dA, "B": ref.dB, "m": ref.dm, "bias": ref.dbias}
    for name in grads_of:
        assert g[name] is not None, f"{tag}: no gradient for {name}"
        assert g[name].dtype == t[name].dtype, f"{tag}: d{name} dtype {g[name].dtype}"
        got, want, base = _np(g[name]), refs[name], _np(gb[name])
        results[f"d{name}"] = (got, want, base)
        representable = np.abs(want) < big
        if not representable.all():
            # The exact gradient is not representable in this dtype there (fp16, zero rows:
            # dB_i = s·g_i·… with g_i = m_i / EPS): judge every other entry.
            got, want, base = got[representable], want[representable], base[representable]
        _close(got, want, base, eps, k, f"{tag} d{name}")
    return results


def _close(actual, reference, baseline, eps, k, name):
    """assert_close on float64 arrays (the rule fails a non-finite result and a non-finite
    baseline); the explicit check names a non-finite result first."""
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    assert_close(actual, reference, baseline, machine_eps=eps, k=k, name=name)


def random_case_tensors(seed=0, *, d_in=24, d_out=20, r=4, lead=(6,), dtype=torch.float32):
    """Small random tensors (x, W, A, B, m, bias, s) for API / edge-case tests."""
    d = cases.Case("adhoc", d_in=d_in, d_out=d_out, r=r, lead=lead).make(seed)
    t = to_torch(d, dtype)
    return t["x"], t["W"], t["A"], t["B"], t["m"], t["bias"], t["s"]


def max_abs(a, b) -> float:
    return float(np.max(np.abs(_np(a) - _np(b)))) if a.numel() else 0.0


def uncached_output(layer, x, *, impl="eager"):
    """A dora_torch.Linear's output for its current parameters with no cache at all: the
    functional path on its tensors (what every cached call must equal, bit for bit). ‖W‖²
    is computed afresh by ``base_sq_norm``, the function the cache uses: the fused tier would
    otherwise sum it inside its one-pass norm kernel, in another order."""
    return dora_torch.dora_linear(
        x,
        layer.weight,
        layer.lora_A,
        layer.lora_B,
        layer.lora_magnitude_vector,
        layer.scaling,
        layer.bias,
        impl=impl,
        base_sq=dora_torch.norm.base_sq_norm(layer.weight),
    )


def scale_reduce_inputs(T, N, D, R, *, seed, device="cpu", dtype=torch.float32) -> dict:
    """Random inputs of ``kernels.backward.scale_reduce`` in recover mode: x [T, D], W [N, D],
    h [T, R], B [N, R], dy and saved (y) [T, N] in ``dtype``; m, n [N] fp32 in [0.5, 1.5)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    x, W, h, B, dy, saved = (randn(*s) for s in ((T, D), (N, D), (T, R), (N, R), (T, N), (T, N)))
    m, n = (torch.rand(N, device=device, generator=g) + 0.5 for _ in range(2))
    return dict(x=x, W=W, h=h, B=B, dy=dy, saved=saved, m=m, n=n)
