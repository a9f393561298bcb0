"""Named test cases that every backend runs against the spec.

Each case fixes shapes and options; ``Case.make(seed)`` draws fresh float64 data
(PyTorch layout). Backends cast the data to their working dtype, then compute
the reference from the *cast* values (see ``tolerances``), so the comparison
measures the implementation, not the rounding of its inputs.

Scales are chosen so every term matters: rows of W and of s·B·A both have norm
about 1, so the cross and Gram terms of the norm are as large as the base term.

The adapter scale s varies across cases (0.5, 1.7 and 3; never 2): at s = 2 the norm's
cross-term coefficient 2s equals its Gram-term coefficient s², so an implementation that
swapped them (or that used s where s² belongs, and so on) would pass every case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .initialization import magnitude_init, scaling_for

# Not 2: see the module doc. Cases that give alpha pick s = 0.5 or s = 3 instead.
DEFAULT_SCALE = 1.7
LARGE = frozenset({"large"})


@dataclass(frozen=True)
class CaseData:
    """One draw of a case (float64, PyTorch layout)."""

    x: np.ndarray  # [*lead, d_in]
    W: np.ndarray  # [d_out, d_in]
    A: np.ndarray  # [r, d_in]
    B: np.ndarray  # [d_out, r]
    m: np.ndarray  # [d_out]
    bias: np.ndarray | None  # [d_out]
    scaling: float
    dy: np.ndarray  # [*lead, d_out], a random cotangent


@dataclass(frozen=True)
class Case:
    name: str
    d_in: int
    d_out: int
    r: int
    lead: tuple[int, ...]  # leading dims of x
    # PEFT's lora_alpha; None: DEFAULT_SCALE·r (s = 1.7; 1.7·sqrt(r) with rsLoRA), resolved
    # at construction so every reader of ``alpha`` (e.g. a PEFT config) sees the value used
    alpha: float | None = None
    use_rslora: bool = False
    bias: bool = True
    fresh: bool = False  # B = 0 and m = magnitude_init: must reproduce the base layer
    zero_rows: tuple[int, ...] = ()  # rows where W and B are zero, so n = 0
    magnitude_jitter: float = 0.1  # m = n·(1 + jitter·N(0, 1)) unless fresh
    tags: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        if self.alpha is None:
            object.__setattr__(self, "alpha", DEFAULT_SCALE * self.r)

    @property
    def scaling(self) -> float:
        return scaling_for(self.r, self.alpha, self.use_rslora)

    def make(self, seed: int = 0) -> CaseData:
        rng = np.random.default_rng(seed)
        s = self.scaling
        x = rng.standard_normal((*self.lead, self.d_in))
        W = rng.standard_normal((self.d_out, self.d_in)) / math.sqrt(self.d_in)
        A = rng.standard_normal((self.r, self.d_in)) / math.sqrt(self.d_in)
        # (B A)_i has norm ≈ sqrt(r)·|B_ij|; pick |B_ij| so that s·(B A)_i has norm ≈ 1.
        B = rng.standard_normal((self.d_out, self.r)) / (s * math.sqrt(self.r))
        if self.fresh:
            B = np.zeros_like(B)
        rows = list(self.zero_rows)
        W[rows] = 0.0
        B[rows] = 0.0
        n = magnitude_init(W, A, B, s)
        if self.fresh:
            m = n
        else:
            m = n * (1.0 + self.magnitude_jitter * rng.standard_normal(self.d_out))
            m[rows] = 0.5  # nonzero magnitude over a zero row: g = m / eps is huge, y stays finite
        bias = rng.standard_normal(self.d_out) if self.bias else None
        dy = rng.standard_normal((*self.lead, self.d_out))
        return CaseData(x, W, A, B, m, bias, s, dy)


CASES: dict[str, Case] = {
    c.name: c
    for c in [
        # alpha = s·r (s·sqrt(r) with rsLoRA); without alpha s = DEFAULT_SCALE = 1.7
        Case("basic", d_in=64, d_out=48, r=8, lead=(16,), alpha=4.0),  # s = 0.5
        Case("odd_shapes", d_in=37, d_out=53, r=5, lead=(13,)),  # s = 1.7
        Case("rank_one", d_in=40, d_out=24, r=1, lead=(9,), alpha=3.0),  # s = 3
        Case("rank_exceeds_d_in", d_in=6, d_out=10, r=12, lead=(7,), alpha=6.0),  # s = 0.5
        Case("no_tokens", d_in=32, d_out=16, r=4, lead=(0,)),  # s = 1.7
        Case("one_token", d_in=32, d_out=16, r=4, lead=(1,), alpha=12.0),  # s = 3
        Case("batched_3d", d_in=24, d_out=20, r=4, lead=(2, 5)),  # s = 1.7
        # s = 3
        Case("zero_base_row", d_in=32, d_out=12, r=4, lead=(8,), alpha=12.0, zero_rows=(0, 5)),
        # s = 1.7
        Case("magnitude_perturbed", d_in=48, d_out=40, r=8, lead=(12,), magnitude_jitter=0.5),
        # s = 0.5
        Case("near_unity_g", d_in=64, d_out=64, r=8, lead=(32,), alpha=4.0, magnitude_jitter=1e-3),
        # s = 12 / sqrt(16) = 3
        Case("rslora", d_in=48, d_out=32, r=16, lead=(10,), alpha=12.0, use_rslora=True),
        Case("no_bias", d_in=32, d_out=24, r=4, lead=(6,), alpha=2.0, bias=False),  # s = 0.5
        Case("fresh_adapter", d_in=32, d_out=24, r=4, lead=(6,), fresh=True),  # s = 1.7
        # s = 3
        Case("multi_block", d_in=300, d_out=260, r=24, lead=(70,), alpha=72.0, tags=LARGE),
    ]
}


def get(name: str) -> Case:
    try:
        return CASES[name]
    except KeyError:
        raise KeyError(f"unknown case {name!r}; known: {sorted(CASES)}") from None
