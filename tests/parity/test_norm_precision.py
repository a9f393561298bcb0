"""One adapter precision rule inside the norm, in both backends.

A (lora_a) is rounded to the base weight's dtype: it meets the weight in U = W Aᵀ (Flax:
aᵀK), and the Gram G = A Aᵀ is formed from the same rounded A, with f32 accumulation. B
(lora_B) enters the assembly at promote(B.dtype, f32), never rounded down. So with a bf16
weight and f32 adapters, dora_torch's eager norm and dora_jax's XLA norm compute the same
float64-defined value up to f32 accumulation order: they agree to a few f32 ulps.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dora_jax
import dora_torch
import shared_spec as S

SHAPES = [  # (d_out, d_in, r, s)
    (40, 96, 8, 1.7),
    (33, 130, 5, 0.5),
    (64, 256, 16, 3.0),
]


def _case(d_out, d_in, r, s, weight_dtype, seed):
    """PyTorch layout, float64 masters: W rounded to ``weight_dtype``, A and B to f32."""
    rng = np.random.default_rng(seed)
    W = torch.tensor(rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)).to(weight_dtype)
    A = torch.tensor(rng.standard_normal((r, d_in)) / np.sqrt(d_in), dtype=torch.float32)
    B = torch.tensor(rng.standard_normal((d_out, r)) / (s * np.sqrt(r)), dtype=torch.float32)
    return W, A, B


def _rule(W, A, B, s) -> np.ndarray:
    """The rule's norm in float64: A rounded to W's dtype, B as given."""
    a = A.to(W.dtype).double().numpy()
    return S.factored_norm(W.double().numpy(), a, B.double().numpy(), s)


def _jax_norm(W, A, B, s) -> np.ndarray:
    kernel, lora_a, lora_b = S.to_flax_layout(W.float().numpy(), A.numpy(), B.numpy())
    jdt = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16, torch.float32: jnp.float32}
    n = dora_jax.factored_norm(
        jnp.asarray(kernel).astype(jdt[W.dtype]),
        jnp.asarray(lora_a),
        jnp.asarray(lora_b),
        s,
        impl="xla",
    )
    assert n.dtype == jnp.float32
    return np.asarray(n, np.float64)


def _torch_norm(W, A, B, s) -> np.ndarray:
    with torch.no_grad():
        n = dora_torch.factored_norm(W, A, B, s, impl="eager")
    assert n.dtype == torch.float32
    return n.double().numpy()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("d_out", "d_in", "r", "s"), SHAPES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_low_precision_weight_f32_adapters_agree(weight_dtype, d_out, d_in, r, s, seed):
    W, A, B = _case(d_out, d_in, r, s, weight_dtype, seed)
    n_torch = _torch_norm(W, A, B, s)
    n_jax = _jax_norm(W, A, B, s)
    rule = _rule(W, A, B, s)
    err_torch = float(np.max(np.abs(n_torch / rule - 1)))
    err_jax = float(np.max(np.abs(n_jax / rule - 1)))
    np.testing.assert_allclose(
        n_jax,
        n_torch,
        rtol=1e-6,
        err_msg=(
            f"max rel. error vs the float64 rule: dora_torch {err_torch:.2e}, "
            f"dora_jax {err_jax:.2e}"
        ),
    )


@pytest.mark.parametrize(("d_out", "d_in", "r", "s"), SHAPES)
def test_f32_weight_agrees(d_out, d_in, r, s):
    """The uncontroversial case: everything f32, both backends compute the same f32 norm."""
    W, A, B = _case(d_out, d_in, r, s, torch.float32, 0)
    np.testing.assert_allclose(_jax_norm(W, A, B, s), _torch_norm(W, A, B, s), rtol=1e-6)
