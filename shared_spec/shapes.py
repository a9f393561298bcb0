"""Argument checks shared by every spec function.

Errors name the offending argument and show the shapes involved, so a user who
passes a transposed matrix or a mismatched rank sees what went wrong at once.
"""

from __future__ import annotations

import math

import numpy as np


def _shape(a) -> tuple[int, ...]:
    return tuple(np.shape(a))


def check_adapter(W, A, B, m=None, bias=None) -> tuple[int, int, int]:
    """Validate PyTorch-layout parameters and return ``(d_out, d_in, r)``.

    W [d_out, d_in], A [r, d_in], B [d_out, r], m [d_out], bias [d_out].
    """
    if np.ndim(W) != 2:
        raise ValueError(f"W must be 2-D [d_out, d_in]; got shape {_shape(W)}")
    d_out, d_in = _shape(W)
    if np.ndim(A) != 2:
        raise ValueError(f"A must be 2-D [r, d_in]; got shape {_shape(A)}")
    if np.ndim(B) != 2:
        raise ValueError(f"B must be 2-D [d_out, r]; got shape {_shape(B)}")
    r = _shape(A)[0]
    if _shape(A)[1] != d_in:
        raise ValueError(
            f"A must have shape [r, d_in] with d_in={d_in} to match W {_shape(W)}; "
            f"got A {_shape(A)}"
        )
    if _shape(B)[0] != d_out:
        raise ValueError(
            f"B must have shape [d_out, r] with d_out={d_out} to match W {_shape(W)}; "
            f"got B {_shape(B)}"
        )
    if _shape(B)[1] != r:
        raise ValueError(
            f"rank mismatch: A {_shape(A)} has rank {r} but B {_shape(B)} has rank {_shape(B)[1]}"
        )
    if r < 1:
        raise ValueError(f"rank must be at least 1; got A {_shape(A)}")
    for name, v in (("m", m), ("bias", bias)):
        if v is not None and _shape(v) != (d_out,):
            raise ValueError(
                f"{name} must have shape [d_out] = ({d_out},) to match W {_shape(W)}; "
                f"got {_shape(v)}"
            )
    return d_out, d_in, r


def check_input(x, d_in: int, name: str = "x") -> None:
    """x [..., d_in] with at least one dimension."""
    if np.ndim(x) < 1 or _shape(x)[-1] != d_in:
        raise ValueError(f"{name} must have shape [..., d_in] with d_in={d_in}; got {_shape(x)}")


def check_output_like(dy, lead: tuple[int, ...], d_out: int, name: str = "dy") -> None:
    if _shape(dy) != (*lead, d_out):
        raise ValueError(f"{name} must have shape {(*lead, d_out)}; got {_shape(dy)}")


def check_scaling(scaling) -> float:
    s = float(scaling)
    if not math.isfinite(s):
        raise ValueError(f"scaling must be a finite number; got {scaling!r}")
    return s
