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


def dense_baseline(x, W, A, B, m, s, bias=None, *, exact=False, keep=None):
    """Plain dense DoRA in the inputs' dtype (the common implementation). ``keep`` is the
    scaled dropout mask (x_d = keep ⊙ x), giving PEFT's dropout form."""
    sq = (W + s * (B @ A)).square().sum(1)
    n = sq.clamp_min(EPS * EPS).sqrt()
    if not exact:
        n = n.detach()
    g = m / n
    if keep is None:
        y = g * (x @ W.t() + s * (x @ A.t()) @ B.t())
    else:
        xd = x * keep
        y = x @ W.t() + (g - 1) * (xd @ W.t()) + g * s * ((xd @ A.t()) @ B.t())
    return y if bias is None else y + bias


def _run(fn, inputs, grads_of, dy):
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in grads_of}
    args = {**inputs, **leaves}
    y = fn(args)
    y.backward(dy)
    return y.detach(), {k: leaves[k].grad for k in grads_of}


def check_tier(
    case_name: str,
    dtype: torch.dtype,
    impl: str,
    *,
    exact: bool = False,
    seed: int = 0,
    device: str = "cpu",
    k: float = 2.0,
    dropout_p: float = 0.0,
) -> None:
    """Assert forward and all gradients of ``dora_linear(impl=...)`` against the spec.

    With ``dropout_p`` the layer runs in training mode with adapter dropout; the mask is
    reproduced from the same RNG seed and given to the spec as ``x_dropped``."""
    d = cases.get(case_name).make(seed)
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
    assert y.dtype == dtype and tuple(y.shape) == tuple(d.dy.shape)
    _close(y, ref_y, yb, eps, k, f"{tag} y")
    refs = {"x": ref.dx, "A": ref.dA, "B": ref.dB, "m": ref.dm, "bias": ref.dbias}
    for name in grads_of:
        assert g[name] is not None, f"{tag}: no gradient for {name}"
        assert g[name].dtype == t[name].dtype, f"{tag}: d{name} dtype {g[name].dtype}"
        if np.abs(refs[name]).max(initial=0.0) >= big:
            continue  # the exact gradient is not representable in this dtype (fp16 zero rows)
        _close(g[name], refs[name], gb[name], eps, k, f"{tag} d{name}")


def _close(actual, reference, baseline, eps, k, name):
    """assert_close, plus: a non-finite result fails even when the baseline is non-finite too
    (the rule's bound is inf then)."""
    a = _np(actual)
    assert np.all(np.isfinite(a)), f"{name}: non-finite values"
    assert_close(a, reference, _np(baseline), machine_eps=eps, k=k, name=name)


def random_case_tensors(seed=0, *, d_in=24, d_out=20, r=4, lead=(6,), dtype=torch.float32):
    """Small random tensors (x, W, A, B, m, bias, s) for API / edge-case tests."""
    d = cases.Case("adhoc", d_in=d_in, d_out=d_out, r=r, lead=lead).make(seed)
    t = to_torch(d, dtype)
    return t["x"], t["W"], t["A"], t["B"], t["m"], t["bias"], t["s"]


def max_abs(a, b) -> float:
    return float(np.max(np.abs(_np(a) - _np(b)))) if a.numel() else 0.0
