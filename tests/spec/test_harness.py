"""The shared case registry and tolerance helper must be able to fail."""

import numpy as np
import pytest

import shared_spec as S
from shared_spec import cases, tolerances


def test_every_case_is_well_formed():
    for name, case in cases.CASES.items():
        d = case.make(0)
        assert d.x.shape == (*case.lead, case.d_in), name
        assert d.dy.shape == (*case.lead, case.d_out), name
        assert (d.bias is None) == (not case.bias), name
        y = S.dora_linear(d.x, d.W, d.A, d.B, d.m, d.scaling, d.bias)
        assert np.all(np.isfinite(y)), name
    # Fresh draws differ between seeds.
    a, b = cases.get("basic").make(0), cases.get("basic").make(1)
    assert not np.array_equal(a.x, b.x)
    with pytest.raises(KeyError, match="unknown case"):
        cases.get("nope")


def test_cases_vary_the_scaling():
    """At s = 2 the norm's cross coefficient 2s equals its Gram coefficient s², so swapping
    them (or s for s²) goes unseen: the cases must use several scales, none of them 2, and
    every scale must be used by an adapter that is not zero (fresh) and has tokens."""
    scales = [c.scaling for c in cases.CASES.values()]
    assert 2.0 not in scales
    live = {c.scaling for c in cases.CASES.values() if not c.fresh and 0 not in c.lead}
    assert len(live) >= 3 and min(live) < 1 < max(live)
    assert cases.Case("adhoc", d_in=4, d_out=3, r=2, lead=(1,)).scaling != 2.0


def test_compare_rule():
    ref = np.linspace(1.0, 2.0, 100)
    baseline = ref * (1 + 1e-3)
    good = ref * (1 + 1.5e-3)
    bad = ref * (1 + 5e-3)
    eps = 2.0**-7
    assert tolerances.compare(good, ref, baseline, machine_eps=eps, floor=0.0).passed
    assert not tolerances.compare(bad, ref, baseline, machine_eps=eps, floor=0.0).passed
    with pytest.raises(AssertionError, match="FAIL"):
        tolerances.assert_close(bad, ref, baseline, machine_eps=eps, floor=0.0, name="y")
    nan = ref.copy()
    nan[3] = np.nan
    assert not tolerances.compare(nan, ref, baseline, machine_eps=eps).passed
    assert not tolerances.compare(nan, ref, nan, machine_eps=eps).passed  # NaN never passes
    # A non-finite baseline gives a non-finite bound, which would accept anything: it fails,
    # and says why, even for an exact result.
    inf_base = ref.copy()
    inf_base[0] = np.inf
    for base in (nan, inf_base):
        c = tolerances.compare(ref, ref, base, machine_eps=eps)
        assert not c.passed and not c.bound_is_finite
        with pytest.raises(AssertionError, match="bound is not finite"):
            tolerances.assert_close(ref, ref, base, machine_eps=eps, name="y")
    assert not tolerances.compare(ref, ref, ref, machine_eps=eps, k=np.inf).passed
    # An exact baseline still leaves the floor.
    assert tolerances.compare(ref * (1 + 1e-4), ref, ref, machine_eps=eps).passed
    # Empty arrays (T = 0) compare equal; mismatched shapes are an error.
    assert tolerances.compare(
        np.zeros((0, 3)), np.zeros((0, 3)), np.zeros((0, 3)), machine_eps=eps
    ).passed
    with pytest.raises(ValueError, match="shape mismatch"):
        tolerances.relative_error(np.zeros(3), np.zeros(4))
