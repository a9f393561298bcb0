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
    # An exact baseline still leaves the floor.
    assert tolerances.compare(ref * (1 + 1e-4), ref, ref, machine_eps=eps).passed
    # Empty arrays (T = 0) compare equal; mismatched shapes are an error.
    assert tolerances.compare(
        np.zeros((0, 3)), np.zeros((0, 3)), np.zeros((0, 3)), machine_eps=eps
    ).passed
    with pytest.raises(ValueError, match="shape mismatch"):
        tolerances.relative_error(np.zeros(3), np.zeros(4))
