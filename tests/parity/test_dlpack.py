"""The DLPack bridge shares buffers both ways and keeps shape and dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dora_jax.interop.dlpack import as_jax, jax_to_torch, torch_to_jax

DTYPES = {
    torch.float32: jnp.float32,
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.int32: jnp.int32,
}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_to_jax_is_zero_copy(dtype):
    t = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) - 5).to(dtype)
    a = torch_to_jax(t)
    assert a.shape == (2, 3, 4)
    assert a.dtype == DTYPES[dtype]
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), t.float().numpy())


def test_jax_to_torch_is_zero_copy_and_round_trips():
    a = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.bfloat16).reshape(3, 4)
    t = jax_to_torch(a)
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (3, 4)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    back = torch_to_jax(t)
    assert back.unsafe_buffer_pointer() == a.unsafe_buffer_pointer()
    assert bool(jnp.all(back == a))


def test_grad_and_non_contiguous_tensors_are_accepted():
    w = torch.randn(4, 6, requires_grad=True)
    np.testing.assert_array_equal(np.asarray(torch_to_jax(w)), w.detach().numpy())
    wt = w.detach().T  # non-contiguous: copied into row-major
    np.testing.assert_array_equal(np.asarray(torch_to_jax(wt)), wt.numpy())


def test_as_jax_dispatch():
    x = np.ones((2, 2), np.float32)
    assert isinstance(as_jax(x), jax.Array)
    assert isinstance(as_jax(torch.ones(2)), jax.Array)
    j = jnp.zeros(3)
    assert as_jax(j) is j
    with pytest.raises(TypeError, match="expected a torch tensor"):
        as_jax([1.0, 2.0])
    with pytest.raises(TypeError, match=r"must be a jax\.Array"):
        jax_to_torch(np.ones(2))
