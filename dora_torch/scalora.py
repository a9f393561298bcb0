"""ScaLoRA for PyTorch: optimally rescale the LoRA columns and merge (arXiv 2510.23818).

Usage (PEFT LoRA/DoRA, ``dora_torch.Linear`` or any module with ``lora_factors()``)::

    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ScaLoRA(model, opt, interval=10).register()   # ScaLoRA-I; runs before each opt.step()
    for batch in loader:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()

The math, the layout mapping and the conventions are those of ``shared_spec/scalora.py``
(read its module doc): project layout W [d_out, d_in], lora_A [r, d_in], lora_B [d_out, r],
scale s; paper A = √s·lora_B, B = √s·lora_Aᵀ. One ScaLoRA step, per layer, between
``loss.backward()`` and ``optimizer.step()``:

1. From the factors and their gradients only (G is never formed), the 2r × 2r system
   K = (S_AᵀS_A) ⊙ (S_BᵀS_B), λ, with S_A = [A, ∇_A] [d_out, 2r], S_B = [∇_B, B] [d_in, 2r]:
   two Gram GEMMs of O((d_out + d_in)·r²), in float64 (cheap, and immune to TF32).
2. All layers of one rank r and device are solved together (one batched Cholesky, see
   ``_solve``); the branch (Theorem 5 "column" if v ≥ 0, else Theorem 3 "scalar", or the
   "zero_gradient" no-op) is chosen per layer on the device with ``torch.where``. ``step()``
   issues no host synchronisation (no ``.item()``, and no eigh/lstsq, which check LAPACK's
   status on the host).
3. In place, under ``no_grad``: W += s·lora_B diag(1 − α⊙β) lora_A (one GEMM
   [d_out, r]×[r, d_in]), lora_B ← lora_B diag(α), lora_A ← diag(β) lora_A. W + s·lora_B·lora_A
   (the layer's function) is unchanged.
4. Gradients. The merge leaves W_eff, hence G = ∇ℓ(W_eff), unchanged, and autograd's
   gradients are ∇_{lora_A} = s·lora_Bᵀ G, ∇_{lora_B} = s·G·lora_Aᵀ. At the new factors
   they are s·(lora_B diag(α))ᵀ G = diag(α)·∇_{lora_A} and s·G·(diag(β) lora_A)ᵀ =
   ∇_{lora_B}·diag(β): the rows of lora_A.grad are scaled by α and the columns of
   lora_B.grad by β (note the swap: each factor's gradient takes the *other* factor's
   scale). The ``optimizer.step()`` that follows then sees exactly the gradients a fresh
   backward at the new factors would give (the tests check this against autograd).
5. Optimizer state moves as the gradients do (``transfer_adam_moments_torch``): Adam/AdamW
   ``exp_avg`` ×α / ×β, ``exp_avg_sq`` and ``max_exp_avg_sq`` ×α² / ×β²; SGD's
   ``momentum_buffer`` (linear in past gradients) ×α / ×β. The step count is kept.

Choosing L·η (``lr_times_L``). The bound's minimiser is w* = [α∘²; β∘²] = u/(Lη), where u,
the solution for Lη = 1, fixes the *direction*: over all column scalings, u maximises the
first-order decrease ⟨G, M(w)⟩ per unit step length ‖M(w)‖_F (M(w) = ÃÃᵀG + GB̃B̃ᵀ is the
SGD step direction on W; for a cone w ≥ 0 the quadratic's minimiser and this ratio's
maximiser are the same ray). L·η only sets the *length*: ‖M(w*)‖ ∝ 1/(Lη), i.e. how large the
rescaled factors are (their columns are ~ (Lη)^(-1/2) in paper units).

- ``lr_times_L=None`` (default, "auto"): per layer and per merge, Lη is the value that keeps
  the first-order step length: ‖M(w*)‖ = ‖M(1)‖ (w = 1 is "no rescaling"), i.e.
  Lη = √(uᵀKu / 1ᵀK1). Justification: L is unknown and not cheaply estimable, and with AdamW
  η is not the learning rate (Adam's step is lr·m̂/√v̂), so no fixed number has a meaning
  that carries across layers, models or optimizers. The auto value takes the step size that
  training has established with its tuned learning rate as the calibration, and ScaLoRA then
  only turns the step toward the bound-optimal direction (and merges). It keeps the length of
  the first-order step M, not the size of the factors: individual columns can still be
  scaled up by large factors (the evidence run, ``benchmarks/results/scalora_evidence.log``,
  saw column scales near 15 and factor norms growing 5-100× over 200 steps, with loss
  spikes at larger learning rates). It is invariant to the gradient scale (loss scaling,
  averaging) and to s, and costs nothing. This is our choice, not the paper's (which treats
  Lη as the constant of its bound).
- ``lr_times_L=c`` (a positive float): the paper's fixed constant, in project units: c = L·η
  with η the SGD step size on lora_A/lora_B; the paper's Lη is s·c. Pick it by a grid
  search; a starting point is ~1/‖√s·lora_B‖²_col of a trained adapter (so that α·β ≈ 1).

Layers found (``find_adapters``), in ``model.named_modules()`` order:

- any module with a method ``lora_factors()`` (the protocol) returning
  ``(base_weight, lora_A, lora_B, scaling)``: base_weight a [d_out, d_in] tensor (or a view
  of one) that the module computes with and that ScaLoRA may write in place; lora_A [r, d_in]
  and lora_B [d_out, r] the trained leaf tensors whose ``.grad`` autograd fills; scaling s > 0
  a Python float, with the layer's function x ↦ x (W + s·lora_B·lora_A)ᵀ (plus anything that
  depends on W only through that sum, such as a detached DoRA norm).
- ``dora_torch.Linear`` (``weight``, ``lora_A``, ``lora_B``, ``scaling``; DoRA).
- PEFT ``lora.Linear`` layers: each active adapter (``lora_A[a].weight``,
  ``lora_B[a].weight``, ``scaling[a]``, ``get_base_layer().weight``, transposed for
  ``fan_in_fan_out``), LoRA or DoRA. Other PEFT LoRA layers (Embedding, Conv, quantized
  bitsandbytes/GPTQ layers) raise. Merged layers and layers with adapters disabled are
  skipped.

DoRA (``dora_torch.Linear``, PEFT DoRA, accelerated PEFT DoRA). The norm is detached: the
layer is a function of V = W + s·B·A (and m), and the merge leaves V unchanged, so the norm
and the magnitude are unchanged and the gradients of lora_A/lora_B are LoRA gradients of V's
factors: the same closed form and gradient rule apply (also with ``exact_norm_grad``, where
the loss still depends on the factors only through V). Modules with a dora_torch norm cache
keep ‖W_i‖² exact without a pass over W: with c = 1 − α⊙β and W' = W + s·B diag(c) A,

    ‖W'_i‖² = ‖W_i‖² + 2s·Σ_j c_j B_ij U_ij + s²·Σ_jk c_j c_k B_ij B_ik G_jk,
    U = W Aᵀ (pre-merge W) [d_out, r],  G = A Aᵀ [r, r]

(expand ‖W_i + s·Σ_j c_j B_ij A_j‖²). U costs one GEMM of d_out·d_in·r, the same order as the
merge GEMM; the rest is O(d_out·r + r²). This is used for fp32/fp64 bases; a 16-bit base is
rounded after the merge, so the formula would describe W + Δ rather than the stored W: there
the cache simply recomputes ‖W‖² on the next forward (one read of W).

Bases. A frozen base (requires_grad=False) is written in place under ``no_grad``; it is not
trained, so nothing else changes. Bases that are trained (requires_grad=True), non-float
(int8, ...) or a Tensor subclass (bitsandbytes, torchao, DTensor, ...) raise, naming the
layer. ``master_weights=True`` keeps an fp32 copy of each 16-bit base, applies the merges to
it and writes the rounded result back, so merges do not accumulate rounding (memory: 4 bytes
per base element; the copy is rebuilt from W if W was written by anyone else).

Limitations: for a singular K other than through zero columns (tiny layers with d < 2r,
exactly parallel terms) the solution may differ from the spec's minimum-norm one, with the
same bound value (see ``_solve``); the closed form needs both gradients (layers where lora_A
or lora_B has no ``.grad`` are skipped: frozen factors, not in this graph); optimizers other
than torch.optim.Adam/AdamW/SGD raise (pass ``optimizer=None`` to manage the state
yourself); sharded parameters (FSDP, DTensor) and PEFT LoRA layers other than lora.Linear
(Embedding, Conv, bitsandbytes) raise; 16-bit adapters round the rescaled factors (relative
2⁻⁹); with GradScaler use ``register()`` (a skipped step does not call the hook) or call
``step()`` after ``scaler.unscale_(optimizer)`` only when the step is taken.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import cache as _cache
from . import checks, config
from .layer import Linear as DoraLinear

BRANCHES = ("column", "scalar", "zero_gradient", "nonfinite")
SCALAR_CASES = ("a_only", "b_only", "both", "degenerate")
COLUMN, SCALAR, ZERO_GRADIENT, NONFINITE = range(4)

_ADAM_FIRST = ("exp_avg",)
_ADAM_SECOND = ("exp_avg_sq", "max_exp_avg_sq")
_SGD_FIRST = ("momentum_buffer",)

#: Refinement steps of the regularised solve and its relative shift (times 2r·eps64).
_SOLVES = 3
_SHIFT = 16.0
#: Relative slack of v ≥ 0 (the spec's ``tol``: exact zeros of v computed with rounding).
_TOL = 1e-12


@dataclass
class Adapter:
    """One LoRA adapter that ScaLoRA rescales. ``base`` is the [d_out, d_in] tensor written
    in place (a transposed view for PEFT ``fan_in_fan_out``); ``weight`` the tensor the
    module owns (the key of its norm cache and of the master copy)."""

    name: str
    module: nn.Module
    weight: torch.Tensor
    base: torch.Tensor
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float

    @property
    def r(self) -> int:
        return self.lora_A.shape[0]


@dataclass(frozen=True)
class ScaLoRAReport:
    """What one ``ScaLoRA.step()`` did. Tensors stay on the device (no host sync); the
    methods ``counts`` and ``branches`` read them (one sync each).

    step: index of this ``step()`` call (0-based). merged: whether it merged (the interval).
    names: the layers merged, in the order of the tensors below. skipped: layers without
    gradients, untouched. branch: [L] int8 codes into ``BRANCHES``. scalar_case: [L] int8
    codes into ``SCALAR_CASES`` (−1 where the branch is not "scalar"). alpha, beta: per layer
    [r] float64 (lora_B's columns were scaled by alpha, lora_A's rows by beta).
    lr_times_L: [L] float64, the paper-unit Lη used (s·lr_times_L, or the auto value).
    """

    step: int
    merged: bool
    names: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    branch: torch.Tensor | None = None
    scalar_case: torch.Tensor | None = None
    alpha: tuple[torch.Tensor, ...] = ()
    beta: tuple[torch.Tensor, ...] = ()
    lr_times_L: torch.Tensor | None = None

    def counts(self) -> dict[str, int]:
        """Layers per branch, e.g. {"column": 10, "scalar": 2, ...} (syncs)."""
        out = dict.fromkeys(BRANCHES, 0)
        if self.branch is not None:
            for code, n in zip(*torch.unique(self.branch, return_counts=True)):
                out[BRANCHES[int(code)]] = int(n)
        return out

    def branches(self) -> dict[str, str]:
        """Layer name → branch, with the scalar case, e.g. "scalar/both" (syncs)."""
        if self.branch is None:
            return {}
        codes, cases = self.branch.tolist(), self.scalar_case.tolist()
        return {
            n: BRANCHES[b] + (f"/{SCALAR_CASES[c]}" if b == SCALAR else "")
            for n, b, c in zip(self.names, codes, cases)
        }


# ---- discovery -------------------------------------------------------------------------


def _peft_classes():
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:  # PEFT is optional
        return None, None
    return LoraLayer, LoraLinear


def _check_adapter(a: Adapter) -> Adapter:
    where = f"ScaLoRA: layer {a.name!r}"
    w = a.weight
    if not isinstance(w, torch.Tensor) or type(w) not in (torch.Tensor, nn.Parameter):
        raise TypeError(
            f"{where}: its base weight is a {type(w).__module__}.{type(w).__name__} (quantized "
            "or wrapped tensor); ScaLoRA merges into the base in place and needs a plain "
            "floating-point tensor"
        )
    if w.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(
            f"{where}: its base weight has dtype {w.dtype} (quantized?); ScaLoRA merges into "
            "the base in place and needs float16/bfloat16/float32/float64"
        )
    if w.requires_grad:
        raise ValueError(
            f"{where}: its base weight requires grad (it is being trained); ScaLoRA writes "
            "the merged adapter into the base, which must be frozen"
        )
    try:
        checks.check_adapter(a.base, a.lora_A, a.lora_B)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    if not (isinstance(a.scaling, float) and math.isfinite(a.scaling) and a.scaling > 0):
        raise ValueError(f"{where}: scaling must be a positive finite float; got {a.scaling!r}")
    return a


def _protocol_adapter(name, module) -> Adapter:
    got = module.lora_factors()
    if not (isinstance(got, tuple | list) and len(got) == 4):
        raise TypeError(
            f"ScaLoRA: layer {name!r}: lora_factors() must return (base_weight, lora_A, "
            f"lora_B, scaling); got {type(got).__name__}"
        )
    w, lora_A, lora_B, s = got
    return Adapter(name, module, w, w, lora_A, lora_B, float(s))


def _peft_adapters(name, module, LoraLinear) -> list[Adapter]:
    if not isinstance(module, LoraLinear):
        raise TypeError(
            f"ScaLoRA: layer {name!r} is a PEFT {type(module).__name__}; only PEFT lora.Linear "
            "layers with a plain nn.Linear-style float base are supported"
        )
    if module.merged or module.disable_adapters:
        return []
    base_layer = module.get_base_layer()
    w = getattr(base_layer, "weight", None)
    if w is None:
        raise TypeError(
            f"ScaLoRA: layer {name!r}: base layer {type(base_layer).__name__} has no float "
            "weight (quantized?); ScaLoRA cannot merge into it"
        )
    view = w.T if getattr(module, "fan_in_fan_out", False) else w
    out = []
    for a in module.active_adapters:
        if a not in module.lora_A:
            continue
        full = name if len(module.active_adapters) == 1 else f"{name}[{a}]"
        lora_A, lora_B = module.lora_A[a].weight, module.lora_B[a].weight
        out.append(Adapter(full, module, w, view, lora_A, lora_B, float(module.scaling[a])))
    return out


def find_adapters(model: nn.Module) -> list[Adapter]:
    """The LoRA adapters ScaLoRA acts on (module doc), validated: a base that cannot be
    written raises with the layer's name. Each lora_A tensor is listed once."""
    LoraLayer, LoraLinear = _peft_classes()
    found: list[Adapter] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        label = name or type(module).__name__
        if callable(getattr(module, "lora_factors", None)):
            new = [_protocol_adapter(label, module)]
        elif isinstance(module, DoraLinear):
            if module.merged:
                continue
            w = module.weight
            new = [Adapter(label, module, w, w, module.lora_A, module.lora_B, module.scaling)]
        elif LoraLayer is not None and isinstance(module, LoraLayer):
            new = _peft_adapters(label, module, LoraLinear)
        else:
            continue
        for a in new:
            if id(a.lora_A) not in seen:
                seen.add(id(a.lora_A))
                found.append(_check_adapter(a))
    return found


# ---- the batched closed form -----------------------------------------------------------


def _system(a: Adapter) -> tuple[torch.Tensor, torch.Tensor]:
    """(K [2r, 2r], λ [2r]) in float64 from the factors and gradients (module doc, step 1)."""
    f64 = torch.float64
    rs = math.sqrt(a.scaling)
    lB, gB = a.lora_B.detach().to(f64), a.lora_B.grad.to(f64)
    lA, gA = a.lora_A.detach().to(f64), a.lora_A.grad.to(f64)
    SA = torch.cat([lB * rs, gB / rs], dim=1)  # [A, ∇_A]      [d_out, 2r]
    SBt = torch.cat([gA / rs, lA * rs], dim=0)  # [∇_B, B]ᵀ    [2r, d_in]
    GA, GB = SA.mT @ SA, SBt @ SBt.mT
    r = a.r
    lam = torch.cat([GB.diagonal()[:r], GA.diagonal()[r:]])  # ‖∇_B cols‖², ‖∇_A cols‖²
    return GA * GB, lam


def _solve(K: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """v with K v = λ (batched [L, 2r, 2r], [L, 2r]), without a host sync.

    λ always lies in range(K). eigh, svd, lstsq and pinv check LAPACK's ``info`` on the host
    (a sync per call), so instead: Jacobi scaling K̂ = D^-½ K D^-½ (unit diagonal; it removes
    the disparate scales of the A and B blocks, e.g. a small lora_B early in training), then
    a Cholesky solve of K̂ + δI, δ = 16·2r·eps, with iterative refinement: for an eigenvalue σ
    of K̂ each refinement multiplies the error by δ/(σ + δ), so a nonsingular K is solved to
    rounding (κ·eps), and directions with σ ≲ δ are damped (a soft form of lstsq's rcond).
    Singular K: a zero diagonal entry (a zero column of a factor or gradient; lora_B = 0 at
    initialisation) zeroes its row, column and λ entry, and v gets exactly 0 there, as in the
    spec's minimum-norm solution. Other singular K (d_out or d_in < 2r, exactly parallel
    terms) have many solutions of K v = λ, all with the same bound value; we return the one
    of least norm in the scaled coordinates, which may differ from the spec's (and then so
    may the sign test of the branch rule).
    """
    n = K.shape[-1]
    d = K.diagonal(dim1=-2, dim2=-1)
    d = torch.where(d > 0, d, 1.0).rsqrt()
    Kh = d[:, :, None] * K * d[:, None, :]
    lh = d * lam
    delta = _SHIFT * n * torch.finfo(K.dtype).eps
    eye = torch.eye(n, dtype=K.dtype, device=K.device)
    C, _ = torch.linalg.cholesky_ex(Kh + delta * eye)  # no error check: no sync

    def solve(rhs):
        y = torch.linalg.solve_triangular(C, rhs[..., None], upper=False)
        return torch.linalg.solve_triangular(C.mT, y, upper=True)[..., 0]

    w = solve(lh)
    for _ in range(_SOLVES - 1):
        w = w + solve(lh - (Kh @ w[..., None])[..., 0])
    return d * w


def _scales(K, lam, r: int, eL_fixed: torch.Tensor | None):
    """Batched branch choice and scales. Returns (ab [L, 2r] = [α; β], branch, case, eL)."""
    # Unit-Lη optimum u (the direction); then w = u / Lη.
    v = _solve(K, lam)
    vmax = v.amax(-1, keepdim=True)
    col = torch.isfinite(v).all(-1) & (v >= -_TOL * vmax).all(-1)
    # Theorem 3 (scalar), every case computed, one selected per layer.
    p, q = lam[:, :r].sum(-1), lam[:, r:].sum(-1)
    x, y = K[:, :r, :r].sum((-2, -1)), K[:, r:, r:].sum((-2, -1))
    z = K[:, :r, r:].sum((-2, -1))
    CA, CB, C = p * y - q * z, q * x - p * z, x * y - z * z
    nondeg = C > 1e-12 * x * y
    both = nondeg & (CA >= 0) & (CB >= 0)
    a_only = nondeg & ~both & (CA > 0)
    b_only = nondeg & ~both & ~a_only

    def safe(t):
        return torch.where(t > 0, t, 1.0)

    sx, sy = x.clamp_min(0).sqrt(), y.clamp_min(0).sqrt()
    t = (p * sx + q * sy) / safe(x * x + 2 * z * sx * sy + y * y)  # "degenerate" (C = 0)
    a = torch.where(both, CA / safe(C), torch.where(a_only, p / safe(x), t * sx))
    b = torch.where(both, CB / safe(C), torch.where(b_only, q / safe(y), t * sy))
    a = torch.where(b_only, 0.0, a)
    b = torch.where(a_only, 0.0, b)
    case = torch.where(both, 2, torch.where(a_only, 0, torch.where(b_only, 1, 3)))
    u_sc = torch.cat([a[:, None].expand(-1, r), b[:, None].expand(-1, r)], dim=1)
    u = torch.where(col[:, None], v.clamp_min(0), u_sc)
    if eL_fixed is None:  # auto: ‖M(u/Lη)‖ = ‖M(1)‖
        uKu = (u[:, None, :] @ K @ u[:, :, None])[:, 0, 0]
        eL = (uKu / safe(K.sum((-2, -1)))).sqrt()
    else:
        eL = eL_fixed
    ab = (u / safe(eL)[:, None]).sqrt()
    zero = ~(lam > 0).any(-1)
    bad = ~(torch.isfinite(ab).all(-1) & (eL > 0) & torch.isfinite(eL))
    noop = zero | bad
    ab = torch.where(noop[:, None], 1.0, ab)
    branch = torch.where(
        zero, ZERO_GRADIENT, torch.where(bad, NONFINITE, torch.where(col, COLUMN, SCALAR))
    ).to(torch.int8)
    case = torch.where(branch == SCALAR, case, -1).to(torch.int8)
    return ab, branch, case, eL


@contextlib.contextmanager
def _ieee_fp32_matmul():
    """fp32 GEMMs at full precision (no TF32) for the merge: its error goes into W."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


# ---- the step ---------------------------------------------------------------------------


class ScaLoRA:
    """ScaLoRA / ScaLoRA-I on every LoRA adapter of ``model`` (module doc).

    ScaLoRA(model, optimizer, *, lr_times_L=None, interval=1, master_weights=False)

    model: the module holding the adapters (found now, to raise early, and again at every
    merge). optimizer: the torch.optim.Adam/AdamW/SGD training them (its state is moved with
    the factors), or None. lr_times_L: None for the auto Lη (the default; module doc) or the
    paper's fixed constant as L·η in project units (paper Lη = s·L·η). interval: ScaLoRA-I's
    I, merge on step() calls 0, I, 2I, ... (1: every step). master_weights: keep fp32
    copies of 16-bit bases.

    ``step()`` goes between ``loss.backward()`` and ``optimizer.step()``; ``register()``
    makes ``optimizer.step()`` call it first. It returns a ``ScaLoRAReport``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        lr_times_L: float | None = None,
        interval: int = 1,
        master_weights: bool = False,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if optimizer is not None and not isinstance(
            optimizer, torch.optim.Adam | torch.optim.AdamW | torch.optim.SGD
        ):
            cls = type(optimizer)
            raise TypeError(
                f"ScaLoRA does not know how to move the state of {cls.__module__}."
                f"{cls.__qualname__}: it rescales torch.optim.Adam/AdamW moments (exp_avg, "
                "exp_avg_sq, max_exp_avg_sq) and SGD's momentum_buffer with the factors. "
                "Pass optimizer=None to keep the state unchanged (it then no longer matches "
                "the rescaled factors)"
            )
        if lr_times_L is not None:
            if isinstance(lr_times_L, bool) or not isinstance(lr_times_L, int | float):
                raise TypeError(f"lr_times_L must be None or a float; got {lr_times_L!r}")
            if not (math.isfinite(lr_times_L) and lr_times_L > 0):
                raise ValueError(f"lr_times_L must be positive and finite; got {lr_times_L!r}")
            lr_times_L = float(lr_times_L)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be a positive int; got {interval!r}")
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool; got {master_weights!r}")
        self.model, self.optimizer = model, optimizer
        self.lr_times_L, self.interval, self.master_weights = lr_times_L, interval, master_weights
        self.steps = 0
        self.last_report: ScaLoRAReport | None = None
        self._masters: dict[int, tuple[Any, torch.Tensor, tuple]] = {}
        if not find_adapters(model):
            raise ValueError(
                f"ScaLoRA found no LoRA layers in {type(model).__name__}: expected PEFT "
                "lora.Linear, dora_torch.Linear or modules with a lora_factors() method"
            )

    # -- public --

    def register(self) -> torch.utils.hooks.RemovableHandle:
        """Run ``step()`` at the start of every ``optimizer.step()`` (a step pre-hook);
        the report goes to ``self.last_report``. Returns the hook's handle."""
        if self.optimizer is None:
            raise ValueError("register() needs the optimizer; ScaLoRA was built with None")

        def hook(_optimizer, _args, _kwargs):
            self.step()

        return self.optimizer.register_step_pre_hook(hook)

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])

    def master_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master copy of ``weight`` (the base as the module owns it; for PEFT
        ``fan_in_fan_out`` the copy is transposed like the base), or None."""
        entry = self._masters.get(id(weight))
        return entry[1] if entry is not None and entry[0]() is weight else None

    @torch.no_grad()
    def step(self) -> ScaLoRAReport:
        """One ScaLoRA step (merges only on calls 0, I, 2I, ...). No host synchronisation."""
        t = self.steps
        self.steps += 1
        if t % self.interval:
            self.last_report = ScaLoRAReport(step=t, merged=False)
            return self.last_report
        adapters = find_adapters(self.model)
        live = [a for a in adapters if a.lora_A.grad is not None and a.lora_B.grad is not None]
        if not live:
            raise RuntimeError(
                "ScaLoRA.step(): no LoRA layer has gradients for both lora_A and lora_B; call "
                "it after loss.backward() and before optimizer.step() (or use register())"
            )
        live_ids = {id(a.lora_A) for a in live}
        skipped = tuple(a.name for a in adapters if id(a.lora_A) not in live_ids)
        groups: dict[tuple, list[Adapter]] = {}
        for a in live:
            groups.setdefault((a.r, a.lora_A.device), []).append(a)
        solved = []
        for (r, _), group in groups.items():  # every system before any write
            systems = [_system(a) for a in group]
            K = torch.stack([k for k, _ in systems])
            lam = torch.stack([lm for _, lm in systems])
            eL = None
            if self.lr_times_L is not None:
                eL = torch.stack([K.new_full((), a.scaling * self.lr_times_L) for a in group])
            solved.append((group, *_scales(K, lam, r, eL)))
        names, alphas, betas, branches, cases, eLs = [], [], [], [], [], []
        with _ieee_fp32_matmul():
            for group, ab, branch, case, eL in solved:
                r = group[0].r
                for i, a in enumerate(group):
                    self._apply(a, ab[i, :r], ab[i, r:])
                    names.append(a.name)
                    alphas.append(ab[i, :r])
                    betas.append(ab[i, r:])
                branches.append(branch)
                cases.append(case)
                eLs.append(eL.to(branch.device))
        dev = branches[0].device
        self.last_report = ScaLoRAReport(
            step=t,
            merged=True,
            names=tuple(names),
            skipped=skipped,
            branch=torch.cat([b.to(dev) for b in branches]),
            scalar_case=torch.cat([c.to(dev) for c in cases]),
            alpha=tuple(alphas),
            beta=tuple(betas),
            lr_times_L=torch.cat([e.to(dev) for e in eLs]),
        )
        return self.last_report

    # -- internals --

    def _apply(self, a: Adapter, alpha: torch.Tensor, beta: torch.Tensor) -> None:
        """Merge, rescale factors and gradients, move the optimizer state (module doc)."""
        W, s = a.base, a.scaling
        cd = torch.promote_types(torch.promote_types(W.dtype, a.lora_A.dtype), torch.float32)
        bc = a.lora_B.to(cd) * (1.0 - alpha * beta).to(cd)  # B diag(1 − α⊙β)  [d_out, r]
        lA = a.lora_A.to(cd)
        norm_cache = self._norm_cache(a)
        if norm_cache is not None:
            old = norm_cache.base_sq(a.weight)
            U, G = W.to(cd) @ lA.mT, lA @ lA.mT

        master = self._master(a) if self.master_weights else None
        if master is not None:
            master.addmm_(bc.float(), lA.float(), alpha=s)
            W.copy_(master)
            self._masters[id(a.weight)] = (*self._masters[id(a.weight)][:2], _stamp(a.weight))
        elif W.dtype == cd:
            W.addmm_(bc, lA, alpha=s)
        else:  # 16-bit base: fp32 product, one rounding; rows in chunks bound the temporary
            rows = max(1, config.SCALORA_MERGE_ELEMS // max(1, W.shape[1]))
            for i in range(0, W.shape[0], rows):
                W[i : i + rows].add_(bc[i : i + rows] @ lA, alpha=s)

        if norm_cache is not None:
            new = old + 2 * s * (bc * U).sum(1) + s * s * ((bc @ G) * bc).sum(1)
            norm_cache.set_base_sq(a.weight, new.to(old.dtype))
        lB_, lA_ = a.lora_B, a.lora_A
        col_a, row_b = alpha.to(lB_.dtype), beta.to(lA_.dtype)[:, None]
        lB_.mul_(col_a)  # lora_B diag(α)
        lA_.mul_(row_b)  # diag(β) lora_A
        lB_.grad.mul_(beta.to(lB_.grad.dtype))  # ∇ lora_B diag(β)
        lA_.grad.mul_(alpha.to(lA_.grad.dtype)[:, None])  # diag(α) ∇ lora_A
        self._transfer(lA_, alpha[:, None])
        self._transfer(lB_, beta)
        if norm_cache is not None or _cache.module_cache(a.module) is not None:
            _cache.refresh_norm_buffer(a.module)  # eval mode only (no-op when training)

    def _transfer(self, p: torch.Tensor, scale: torch.Tensor) -> None:
        state = self.optimizer.state.get(p) if self.optimizer is not None else None
        if not state:
            return
        for key in _ADAM_FIRST + _SGD_FIRST:
            m = state.get(key)
            if isinstance(m, torch.Tensor):
                m.mul_(scale.to(m.dtype))
        for key in _ADAM_SECOND:
            v = state.get(key)
            if isinstance(v, torch.Tensor):
                v.mul_(scale.square().to(v.dtype))

    @staticmethod
    def _norm_cache(a: Adapter):
        """The dora_torch norm cache keyed on this adapter's W (fp32/fp64 bases only)."""
        nc = _cache.module_cache(a.module)
        if nc is None or a.weight.dtype not in (torch.float32, torch.float64):
            return None
        found = a.module._dora_tensors(a.module)
        if found is None or found[0] is not a.weight or found[1] is not a.lora_A:
            return None
        return nc

    def _master(self, a: Adapter) -> torch.Tensor | None:
        """fp32 master of a 16-bit base (created, or rebuilt if W was written elsewhere)."""
        if a.weight.dtype not in (torch.float16, torch.bfloat16):
            return None
        entry = self._masters.get(id(a.weight))
        if entry is None or entry[0]() is not a.weight or entry[2] != _stamp(a.weight):
            for key in [k for k, e in self._masters.items() if e[0]() is None]:
                del self._masters[key]  # bases that no longer exist
            entry = (weakref.ref(a.weight), a.base.float(), _stamp(a.weight))
            self._masters[id(a.weight)] = entry
        return entry[1]


def _stamp(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t._version, t.shape, t.dtype)
