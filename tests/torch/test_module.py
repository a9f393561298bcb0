"""dora_torch.Linear: construction, state dict, cache invalidation, merge/unmerge."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dora_torch

from .helpers import uncached_output


def _trained(layer: dora_torch.Linear, seed=0) -> dora_torch.Linear:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.1)
        layer.lora_magnitude_vector.mul_(1 + 0.1 * torch.randn(layer.out_features, generator=g))
    return layer


def test_parameters_and_state_dict_keys():
    layer = dora_torch.Linear(12, 8, r=4, lora_alpha=8)
    assert set(layer.state_dict()) == {
        "weight",
        "bias",
        "lora_A",
        "lora_B",
        "lora_magnitude_vector",
    }
    trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trainable == {"lora_A", "lora_B", "lora_magnitude_vector"}
    assert layer.lora_A.shape == (4, 12) and layer.lora_B.shape == (8, 4)
    assert layer.lora_A.dtype == torch.float32
    assert layer.scaling == 2.0
    assert dora_torch.Linear(12, 8, r=4, lora_alpha=8, use_rslora=True).scaling == 4.0
    layer2 = dora_torch.Linear(12, 8, r=4, lora_alpha=8)
    layer2.load_state_dict(layer.state_dict())
    x = torch.randn(3, 12)
    torch.testing.assert_close(layer2(x), layer(x))


def test_from_linear_shares_weight_without_copy():
    lin = nn.Linear(10, 6, dtype=torch.bfloat16)
    layer = dora_torch.Linear.from_linear(lin, r=2, lora_alpha=4)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert layer.weight.data_ptr() == lin.weight.data_ptr()
    assert not layer.weight.requires_grad
    with pytest.raises(TypeError, match=r"linear must be a torch\.nn\.Linear"):
        dora_torch.Linear.from_linear(nn.Conv1d(2, 2, 1), r=2, lora_alpha=4)
    with pytest.raises(ValueError, match="r must be a positive int"):
        dora_torch.Linear(4, 4, r=0, lora_alpha=1)


@pytest.mark.parametrize("which", ["lora_A", "lora_B", "weight"])
def test_in_place_edits_invalidate_the_norm_cache(which):
    layer = _trained(dora_torch.Linear(16, 12, r=4, lora_alpha=8))
    x = torch.randn(5, 16)
    with torch.no_grad():
        layer(x)
        layer(x)
    cache = layer._dora_norm_cache
    assert cache.norm_computations == 1  # reused while nothing changed
    with torch.no_grad():
        getattr(layer, which).mul_(1.5)  # in place: version counter moves
        y = layer(x)
    assert cache.norm_computations == 2
    torch.testing.assert_close(y, uncached_output(layer, x).detach())


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("which", ["lora_A", "lora_B"])
def test_calls_reuse_adapter_casts_until_an_edit(which, grad):
    # bf16 activations with fp32 adapters: inference calls and the micro-batches of one
    # optimizer step reuse the bf16 casts of A and B; an edit of either recasts both.
    layer = _trained(dora_torch.Linear(16, 12, r=4, lora_alpha=8, dtype=torch.bfloat16))
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    cache = layer._dora_norm_cache

    def casts():
        return cache.state(
            layer.weight, layer.lora_A, layer.lora_B, layer.scaling, impl="eager",
            dtype=torch.bfloat16,
        )[1:]  # fmt: skip

    with torch.set_grad_enabled(grad):
        layer(x)
        first = casts()
        assert first[0].dtype == torch.bfloat16 and not first[0].requires_grad
        layer(x)
        assert casts()[0] is first[0] and casts()[1] is first[1]
        with torch.no_grad():
            getattr(layer, which).add_(0.25)  # e.g. an optimizer step
        y = layer(x)
    assert casts()[0] is not first[0]
    torch.testing.assert_close(y.detach(), uncached_output(layer, x).detach())


def test_replaced_weight_invalidates_base_norm():
    layer = _trained(dora_torch.Linear(16, 12, r=4, lora_alpha=8))
    x = torch.randn(5, 16)
    layer(x)
    layer.weight = nn.Parameter(torch.randn(12, 16), requires_grad=False)
    torch.testing.assert_close(layer(x).detach(), uncached_output(layer, x).detach())
    layer.load_state_dict({k: v * 2 for k, v in layer.state_dict().items()})  # copy_ in place
    torch.testing.assert_close(layer(x).detach(), uncached_output(layer, x).detach())


def test_gradient_accumulation_reuses_norm_until_optimizer_step():
    layer = _trained(dora_torch.Linear(16, 12, r=4, lora_alpha=8))
    opt = torch.optim.SGD([p for p in layer.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):  # micro-batches
        layer(torch.randn(4, 16)).square().sum().backward()
    assert layer._dora_norm_cache.norm_computations == 1
    opt.step()
    x = torch.randn(4, 16)
    torch.testing.assert_close(layer(x).detach(), uncached_output(layer, x).detach())
    assert layer._dora_norm_cache.norm_computations == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_unmerge_round_trip(dtype):
    layer = _trained(dora_torch.Linear(16, 12, r=4, lora_alpha=8, dtype=dtype))
    x = torch.randn(5, 16, dtype=dtype)
    w0 = layer.weight.detach().clone()
    with torch.no_grad():
        y = layer(x)
        layer.merge()
        ym = layer(x)
    assert layer.merged and layer.last_impl == "merged"
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.03, "atol": 0.03}
    torch.testing.assert_close(ym, y, **tol)
    layer.unmerge()
    assert not layer.merged
    torch.testing.assert_close(layer.weight, w0, **tol)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), y, **tol)


def test_unmerge_refuses_zero_magnitude():
    layer = _trained(dora_torch.Linear(8, 6, r=2, lora_alpha=4))
    with torch.no_grad():
        layer.lora_magnitude_vector[2] = 0
    layer.merge()
    with pytest.raises(ValueError, match="zero magnitude"):
        layer.unmerge()


def test_impl_is_visible_and_overridable():
    layer = dora_torch.Linear(16, 12, r=4, lora_alpha=8)
    layer(torch.randn(2, 16))
    assert layer.last_impl == "eager"  # CPU → eager under "auto"
    layer.impl = "fused"
    layer(torch.randn(2, 16))
    assert layer.last_impl == "fused"


def test_exact_norm_grad_module_differs_from_detached():
    torch.manual_seed(0)
    a = _trained(dora_torch.Linear(16, 12, r=4, lora_alpha=8))
    b = dora_torch.Linear(16, 12, r=4, lora_alpha=8, exact_norm_grad=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(6, 16)
    a(x).square().sum().backward()
    b(x).square().sum().backward()
    torch.testing.assert_close(a.lora_magnitude_vector.grad, b.lora_magnitude_vector.grad)
    assert not torch.allclose(a.lora_B.grad, b.lora_B.grad)
