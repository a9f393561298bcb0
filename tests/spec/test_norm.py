import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shared_spec as S
from shared_spec import cases


@settings(max_examples=60, deadline=None)
@given(
    d_out=st.integers(1, 40),
    d_in=st.integers(1, 40),
    r=st.integers(1, 24),
    s=st.floats(0.01, 8.0),
    chunk=st.one_of(st.none(), st.integers(1, 17)),
    seed=st.integers(0, 2**31 - 1),
)
def test_factored_equals_dense(d_out, d_in, r, s, chunk, seed):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((d_out, d_in))
    A = rng.standard_normal((r, d_in))
    B = rng.standard_normal((d_out, r))
    dense = S.dense_norm(W, A, B, s)
    fact = S.factored_norm(W, A, B, s, chunk=chunk)
    np.testing.assert_allclose(fact, dense, rtol=1e-10, atol=1e-12 * np.abs(dense).max())


def test_precomputed_base_sq_is_used():
    d = cases.get("basic").make(3)
    base_sq = S.base_sq_norm(d.W)
    np.testing.assert_allclose(
        S.factored_norm(d.W, d.A, d.B, d.scaling, base_sq=base_sq),
        S.dense_norm(d.W, d.A, d.B, d.scaling),
        rtol=1e-12,
    )
    # A wrong base_sq must change the result: the argument is really read.
    wrong = S.factored_norm(d.W, d.A, d.B, d.scaling, base_sq=base_sq + 1.0)
    assert np.all(wrong > S.dense_norm(d.W, d.A, d.B, d.scaling))


def test_zero_row_clamps_to_zero():
    # W_i = -s·(BA)_i exactly: the factored sum may round below 0; the result must be 0, not NaN.
    rng = np.random.default_rng(0)
    A = rng.standard_normal((3, 9))
    B = rng.standard_normal((4, 3))
    s = 0.7
    W = rng.standard_normal((4, 9))
    W[2] = -s * (B[2] @ A)
    n = S.factored_norm(W, A, B, s)
    assert np.all(np.isfinite(n))
    assert n[2] < 1e-6


@pytest.mark.parametrize(
    "shapes, match, shown",
    [
        (((4, 6), (3, 6), (4, 2)), "rank mismatch", "(4, 2)"),
        (((4, 6), (3, 5), (4, 3)), "A must have shape", "(3, 5)"),
        (((4, 6), (3, 6), (5, 3)), "B must have shape", "(5, 3)"),
        (((4, 6, 1), (3, 6), (4, 3)), "W must be 2-D", "(4, 6, 1)"),
        (((4, 6), (6,), (4, 3)), "A must be 2-D", "(6,)"),
    ],
)
def test_bad_shapes_name_the_argument(shapes, match, shown):
    W, A, B = (np.zeros(s) for s in shapes)
    for fn in (S.factored_norm, S.dense_norm):
        with pytest.raises(ValueError, match=match) as e:
            fn(W, A, B, 1.0)
        assert shown in str(e.value)


def test_bad_chunk_and_scaling():
    d = cases.get("basic").make(0)
    with pytest.raises(ValueError, match="chunk"):
        S.factored_norm(d.W, d.A, d.B, 1.0, chunk=0)
    with pytest.raises(ValueError, match="scaling"):
        S.factored_norm(d.W, d.A, d.B, float("nan"))
    with pytest.raises(ValueError, match="base_sq"):
        S.factored_norm(d.W, d.A, d.B, 1.0, base_sq=np.ones(3))


def test_scaling_for():
    assert S.scaling_for(8, 16) == 2.0
    assert S.scaling_for(16, 8, use_rslora=True) == 2.0
    with pytest.raises(ValueError, match="r must be"):
        S.scaling_for(0, 8)
