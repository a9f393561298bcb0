"""The comparison rule every backend uses against the float64 spec.

A result in a working dtype passes when its error against the float64 reference
is no worse than ``k`` times the error of *plain framework code in the same
dtype* (the baseline), plus a small floor for the case where the baseline happens
to be exact:

    err(actual) <= k · err(baseline) + floor,   err(a) = ||a − ref||_F / ||ref||_F

``floor`` defaults to a quarter of the dtype's machine epsilon (relative). NaN or
inf in ``actual`` never passes. Neither does anything when the bound is not finite
(the baseline gave NaN or inf, or k or floor is not finite): such a bound would
accept every finite result, so the rule reports the comparison as failed and says
why; fix the baseline instead (e.g. an fp16 baseline whose norm underflows). The
reference must be computed from the inputs *after* casting them to the working
dtype, so only the computation is judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULT_K = 2.0


def relative_error(actual, reference) -> float:
    """Relative Frobenius error in float64; inf if ``actual`` is not finite."""
    a = np.asarray(actual, np.float64)
    r = np.asarray(reference, np.float64)
    if a.shape != r.shape:
        raise ValueError(f"shape mismatch: actual {a.shape} vs reference {r.shape}")
    if a.size == 0:
        return 0.0
    if not np.all(np.isfinite(a)):
        return float("inf")
    denom = np.linalg.norm(r)
    return float(np.linalg.norm(a - r) / (denom if denom > 0 else 1.0))


@dataclass(frozen=True)
class Comparison:
    name: str
    error: float
    baseline_error: float
    bound: float

    @property
    def bound_is_finite(self) -> bool:
        return math.isfinite(self.bound)

    @property
    def passed(self) -> bool:
        # A non-finite result never passes; a non-finite bound (the baseline gave NaN/inf)
        # cannot judge anything, so nothing passes against it either.
        return math.isfinite(self.error) and self.bound_is_finite and self.error <= self.bound

    def __str__(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        text = (
            f"{self.name or 'result'}: rel err {self.error:.3g} vs bound {self.bound:.3g} "
            f"(baseline {self.baseline_error:.3g}) {verdict}"
        )
        if not self.bound_is_finite:
            text += (
                ": the bound is not finite (the baseline's result has NaN or inf), so the "
                "rule cannot judge this result; make the baseline finite"
            )
        return text


def compare(
    actual, reference, baseline, *, machine_eps: float, k: float = DEFAULT_K, floor=None, name=""
) -> Comparison:
    """Measure ``actual`` and ``baseline`` against ``reference``; see the module doc.

    machine_eps: the working dtype's epsilon (``torch.finfo(dt).eps``,
    ``jnp.finfo(dt).eps``): 2⁻⁷ for bf16, 2⁻¹⁰ for fp16, 2⁻²³ for fp32.
    """
    floor = machine_eps / 4 if floor is None else floor
    base_err = relative_error(baseline, reference)
    return Comparison(name, relative_error(actual, reference), base_err, k * base_err + floor)


def assert_close(
    actual, reference, baseline, *, machine_eps: float, k: float = DEFAULT_K, floor=None, name=""
) -> Comparison:
    """``compare`` and raise AssertionError with the numbers when it fails."""
    c = compare(actual, reference, baseline, machine_eps=machine_eps, k=k, floor=floor, name=name)
    if not c.passed:
        raise AssertionError(str(c))
    return c
