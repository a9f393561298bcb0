"""One definition each, in dora_jax, of g = m / max(n, eps) with g − 1 = (m − n)/n, and of the
d_in chunking; every caller uses them (read from the source, so a new copy fails here)."""

from __future__ import annotations

import ast
import pathlib

import jax.numpy as jnp
import numpy as np

import dora_jax
from dora_jax import merge, norm, vjp, xla_ops

ROOT = pathlib.Path(dora_jax.__file__).parent
# baselines.py is the naive DoRA the tests measure against: its own g on purpose
EXCLUDED = {"baselines.py"}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        if path.name not in EXCLUDED:
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def _names(tree, name):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name]


def _calls(tree, func_name):
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and getattr(n.func, "id", getattr(n.func, "attr", None)) == func_name
    ]


def _defs(tree, name):
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]


def test_eps_clamp_lives_in_one_place():
    """Only xla_ops touches eps; everyone else clamps n through its helpers."""
    users = sorted(mod for mod, tree in _modules() if _names(tree, "EPS"))
    assert users == ["xla_ops.py"], users


def test_each_helper_is_defined_once():
    for helper in ("magnitude_scale", "magnitude_scale_minus_one", "safe_norm", "chunk_slices"):
        where = [mod for mod, tree in _modules() if _defs(tree, helper)]
        assert len(where) == 1, (helper, where)


def test_chunking_lives_in_one_place():
    users = sorted(mod for mod, tree in _modules() if _calls(tree, "slice"))
    assert users == ["norm.py"], users
    assert [
        n.name
        for n in ast.walk(ast.parse((ROOT / "norm.py").read_text()))
        if isinstance(n, ast.FunctionDef) and _calls(n, "slice")
    ] == ["chunk_slices"]


def test_callers_use_the_shared_helpers():
    assert vjp.magnitude_scale is xla_ops.magnitude_scale
    assert vjp.magnitude_scale_minus_one is xla_ops.magnitude_scale_minus_one
    assert merge.magnitude_scale is xla_ops.magnitude_scale
    for mod, tree in _modules():
        if mod in ("xla_ops.py",):
            continue
        for fn in ("maximum",):
            for call in _calls(tree, fn):
                assert "EPS" not in ast.unparse(call), (mod, ast.unparse(call))


def test_helpers_compute_what_they_say():
    m = jnp.asarray([1.0, 2.0, 0.5], jnp.float32)
    n = jnp.asarray([2.0, 0.0, 0.5], jnp.float32)
    g = xla_ops.magnitude_scale(m, n, jnp.float32)
    np.testing.assert_allclose(g, [0.5, 2.0 / 1e-12, 1.0], rtol=1e-7)
    g1 = xla_ops.magnitude_scale_minus_one(m, n, jnp.float32)
    np.testing.assert_allclose(g1, [-0.5, (2.0 - 1e-12) / 1e-12, 0.0], rtol=1e-7)
    assert norm.chunk_slices(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert norm.chunk_slices(10, None) == [slice(0, 10)]
    assert norm.chunk_slices(0, 3) == [slice(0, 0)]
