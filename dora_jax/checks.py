"""Argument checks for the Flax-layout API: errors name the argument and show the shapes.

Flax layout: x [..., d_in], kernel [d_in, d_out], lora_a [d_in, r], lora_b [r, d_out],
magnitude, bias, norm and base_sq [d_out].
"""

from __future__ import annotations

import math

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
