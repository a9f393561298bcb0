"""The lowered program of the XLA path: which GEMMs it runs, in which dtypes (the HLO audit).

Checked on StableHLO (before XLA's backend passes, which on CPU upcast every bf16 dot to f32)
with bf16 activations and f32 adapter parameters, and all four sizes distinct so a dot's
shapes say what it is. Targets: every GEMM that contracts over d_in, d_out or the tokens takes
activation-dtype operands (f32 operands only for the small rank-sized contractions of the
norm); no dense [d_in, d_out] product (a·b is never formed); no transpose of the kernel; and
no GEMM beyond LoRA's but the norm's U = aᵀK, G = aᵀa and G·b, each computed once.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from dora_jax.baselines import lora_dense
from dora_jax.functional import dora_dense

T, D_IN, D_OUT, R = 64, 256, 384, 16
BF16, F32 = jnp.bfloat16, jnp.float32
S = jax.ShapeDtypeStruct
X, DY = S((T, D_IN), BF16), S((T, D_OUT), BF16)
K = S((D_IN, D_OUT), BF16)
A, B, M, NORM = S((D_IN, R), F32), S((R, D_OUT), F32), S((D_OUT,), F32), S((D_OUT,), F32)

_DOT = re.compile(
    r"stablehlo\.dot_general .*?contracting_dims = \[(\d+)\] x \[(\d+)\].*?"
    r":\s*\(tensor<([0-9x]+)x(\w+)>, tensor<([0-9x]+)x(\w+)>\)\s*->\s*tensor<([0-9x]+)x(\w+)>"
)


def _dots(fn, *args):
    """[(lhs shape, lhs dtype, rhs shape, rhs dtype, contracted size, out shape)]"""
    text = jax.jit(fn).lower(*args).as_text()
    dots = []
    for line in text.splitlines():
        if "dot_general" not in line:
            continue
        m = _DOT.search(line)
        assert m, f"unparsed dot: {line.strip()}"
        lc, _, ls, lt, rs, rt, os_, _ = m.groups()
        lshape = tuple(int(v) for v in ls.split("x"))
        rshape = tuple(int(v) for v in rs.split("x"))
        out = tuple(int(v) for v in os_.split("x"))
        dots.append((lshape, lt, rshape, rt, lshape[int(lc)], out))
    return dots, text


def _ours(**kw):
    return lambda x, a, b, m, k: dora_dense(x, k, a, b, m, 2.0, impl="xla", **kw)


def _grad(f, n_diff):
    def step(x, dy, *params):
        y, pull = jax.vjp(lambda *d: f(*d, *params[n_diff - 1 :]), x, *params[: n_diff - 1])
        return y, pull(dy)

    return step


def _check(dots, text):
    for lshape, lt, rshape, rt, contracted, out in dots:
        if contracted != R:  # contracts over d_in, d_out or the tokens: a big GEMM
            assert (lt, rt) == ("bf16", "bf16"), (lshape, lt, rshape, rt)
        assert out != (D_IN, D_OUT), "a dense [d_in, d_out] product was formed"
    kernel_t = f"tensor<{D_OUT}x{D_IN}xbf16>"  # a transposed copy of the kernel
    assert kernel_t not in text, "the kernel is transposed (or cast) instead of contracted"


@pytest.mark.parametrize(
    ("name", "fn", "args", "n_dots"),
    [
        ("lora fwd", lambda x, a, b, k: lora_dense(x, k, a, b, 2.0), (X, A, B, K), 3),
        ("fwd", _ours(), (X, A, B, M, K), 6),  # LoRA's 3 + U, G, G·b
        ("grad", _grad(_ours(), 4), (X, DY, A, B, M, K), 11),  # LoRA's 8 + U, G, G·b
        ("exact grad", _grad(_ours(exact_norm_grad=True), 4), (X, DY, A, B, M, K), 14),
    ],
)
def test_dots(name, fn, args, n_dots):
    dots, text = _dots(fn, *args)
    assert len(dots) == n_dots, (name, dots)
    if not name.startswith("lora"):
        _check(dots, text)


def test_frozen_norm_runs_only_lora_gemms():
    def fwd(x, a, b, m, k, n):
        return dora_dense(x, k, a, b, m, 2.0, impl="xla", norm=n)

    def x_grad(x, dy, a, b, m, k, n):
        y, pull = jax.vjp(lambda x: fwd(x, a, b, m, k, n), x)
        return y, pull(dy)

    dots, text = _dots(fwd, X, A, B, M, K, NORM)
    assert len(dots) == 3
    _check(dots, text)
    dots, text = _dots(x_grad, X, DY, A, B, M, K, NORM)
    assert len(dots) == 6  # + dy_g·bᵀ, dy_g·Kᵀ, q·aᵀ
    _check(dots, text)


def _main_uses_of_dy(dtype):
    """The ops of the grad program's main function that read the cotangent dy (%arg1)."""
    x, dy, k = S((T, D_IN), dtype), S((T, D_OUT), dtype), S((D_IN, D_OUT), dtype)
    text = jax.jit(_grad(_ours(), 4)).lower(x, dy, A, B, M, k).as_text()
    main = text[text.index("func.func public @main") :]
    main = main[: main.index("\n  }")]
    body = main.splitlines()[1:]
    return [re.search(r"= (\S+)", line).group(1) for line in body if "%arg1" in line]


def test_the_backward_gemms_read_g_dy_not_dy():
    """bf16: dy's only readers are the elementwise scale-and-reduce (converts); every GEMM
    takes dy_g (db = s·hᵀ·dy_g, as the spec). f16 keeps P = hᵀ·dy for db (dy_g saturates in
    f16), so there a GEMM reads dy."""
    uses = _main_uses_of_dy(BF16)
    assert uses and all(op == "stablehlo.convert" for op in uses), uses
    assert "stablehlo.dot_general" in _main_uses_of_dy(jnp.float16)
