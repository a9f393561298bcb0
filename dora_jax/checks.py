"""Argument checks for the Flax-layout API: errors name the argument and show the shapes.

Flax layout: x [..., d_in], kernel [d_in, d_out], lora_a [d_in, r], lora_b [r, d_out],
magnitude, bias, norm and base_sq [d_out].
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import jax.numpy as jnp
import numpy as np


def _shape(a) -> tuple[int, ...]:
    return tuple(np.shape(a))


def check_floating(name: str, a) -> None:
    if a is not None and not jnp.issubdtype(jnp.result_type(a), jnp.floating):
        raise ValueError(f"{name} must have a floating dtype; got {jnp.result_type(a)}")


def check_adapter(kernel, lora_a, lora_b) -> tuple[int, int, int]:
    """Check kernel [d_in, d_out], lora_a [d_in, r], lora_b [r, d_out]; return (d_in, d_out, r)."""
    for name, v, want in (
        ("kernel", kernel, "[d_in, d_out]"),
        ("lora_a", lora_a, "[d_in, r]"),
        ("lora_b", lora_b, "[r, d_out]"),
    ):
        if np.ndim(v) != 2:
            raise ValueError(f"{name} must be 2-D {want}; got shape {_shape(v)}")
        check_floating(name, v)
    d_in, d_out = _shape(kernel)
    if _shape(lora_a)[0] != d_in:
        raise ValueError(
            f"lora_a must have shape [d_in, r] with d_in={d_in} to match kernel {_shape(kernel)}; "
            f"got lora_a {_shape(lora_a)}"
        )
    r = _shape(lora_a)[1]
    if r < 1:
        raise ValueError(f"rank must be at least 1; got lora_a {_shape(lora_a)}")
    if _shape(lora_b) != (r, d_out):
        raise ValueError(
            f"lora_b must have shape [r, d_out] = ({r}, {d_out}) to match lora_a "
            f"{_shape(lora_a)} and kernel {_shape(kernel)}; got lora_b {_shape(lora_b)}"
        )
    return d_in, d_out, r


def check_vector(name: str, v, d_out: int) -> None:
    """v is None or [d_out] floating."""
    if v is None:
        return
    if _shape(v) != (d_out,):
        raise ValueError(f"{name} must have shape [d_out] = ({d_out},); got {_shape(v)}")
    check_floating(name, v)


def check_input(x, d_in: int) -> None:
    if np.ndim(x) < 1 or _shape(x)[-1] != d_in:
        raise ValueError(f"x must have shape [..., d_in] with d_in={d_in}; got {_shape(x)}")
    check_floating("x", x)


def check_scaling(scaling) -> float:
    """The adapter scale must be a concrete finite number (it is a static kernel parameter)."""
    try:
        s = float(scaling)
    except Exception as e:  # a tracer or an array with several elements
        raise ValueError(f"scaling must be a concrete Python number; got {scaling!r}") from e
    if not math.isfinite(s):
        raise ValueError(f"scaling must be finite; got {scaling!r}")
    return s


def check_chunk_size(chunk_size) -> int | None:
    if chunk_size is None:
        return None
    if int(chunk_size) != chunk_size or int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive integer or None; got {chunk_size!r}")
    return int(chunk_size)


def check_dropout(rate, rng=None, deterministic=True, *, name: str = "dropout_rate") -> float:
    """Adapter dropout arguments; returns the rate as a float."""
    try:
        p = float(rate)
    except Exception as e:  # a tracer: whether dropout runs must be known when tracing
        raise ValueError(f"{name} must be a concrete Python number; got {rate!r}") from e
    if not 0.0 <= p < 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1); got {rate!r}")
    if p > 0.0 and not deterministic and rng is None:
        raise ValueError(
            f"dropout_rng (a jax.random key) is required when dropout_rate={p} > 0 and "
            "deterministic=False"
        )
    return p


def caller_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel of the first frame outside dora_jax, flax and jax (the
    user's line, however deep Flax's module construction or JAX's tracing machinery is)."""
    skip = tuple(
        os.path.dirname(os.path.abspath(m.__file__)) + os.sep
        for m in (sys.modules[__name__.rsplit(".", 1)[0]], sys.modules["flax"], sys.modules["jax"])
    )
    level, frame = 1, sys._getframe(1)  # stacklevel 1 is the caller of warnings.warn
    while frame is not None and (
        frame.f_code.co_filename == "<string>"  # dataclass-generated __init__ (linen)
        or os.path.abspath(frame.f_code.co_filename).startswith(skip)
    ):
        level, frame = level + 1, frame.f_back
    return level


def renamed_argument(owner: str, new_name: str, new, old_name: str, old):
    """The value of an argument renamed to PEFT's vocabulary (``rank`` → ``r``, ...).

    ``new``/``old`` are the values passed under each name (None: not passed). The old name still
    works for one release with a DeprecationWarning naming the new one (attributed to the
    caller's line); passing both, or neither, is a TypeError (the argument is required).
    """
    if old is None:
        if new is None:
            raise TypeError(f"{owner} missing required keyword argument {new_name!r}")
        return new
    if new is not None:
        raise TypeError(
            f"{owner} got both {new_name!r} and its deprecated alias {old_name!r}; "
            f"pass only {new_name!r}"
        )
    warnings.warn(
        f"{owner}: the keyword {old_name!r} is deprecated; use {new_name!r} (PEFT's name)",
        DeprecationWarning,
        stacklevel=caller_stacklevel(),
    )
    return old


def check_rank(r) -> int:
    """The adapter rank r: a positive integer."""
    if isinstance(r, bool) or int(r) != r or r < 1:
        raise ValueError(f"r (the adapter rank) must be a positive integer; got {r!r}")
    return int(r)
