"""The host-time measures of the eager hot path (benchmarks/NOTES.md, session 5) keep the math:
row-blocked norms, the Triton launch cache's key, and the one-GEMM scaled adapter gradients."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import dora_torch
from dora_torch import config
from dora_torch.kernels.compose import _launch_compose
from dora_torch.kernels.launch import Launcher, hooks_set, launch_form
from dora_torch.matmul import scaled_mm
from dora_torch.norm import base_sq_norm, detached_norm

gpu = pytest.mark.gpu


@pytest.mark.parametrize("fused", [False, True])
def test_row_blocked_norm_equals_one_block(monkeypatch, fused):
    # The fused tier runs on CUDA, or on CPU through the Triton interpreter (CPU CI).
    device = "cuda" if fused and not config.interpreting() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the fused tier needs CUDA or the Triton interpreter")
    torch.manual_seed(0)
    W, A, B = (torch.randn(*shape, device=device) for shape in ((37, 24), (4, 24), (37, 4)))
    base_sq = base_sq_norm(W)
    whole = detached_norm(W, A, B, base_sq, 0.7, fused)
    monkeypatch.setattr(config, "NORM_U_ELEMENTS", 4 * 10)  # 10 rows per block: 4 blocks
    assert config.norm_row_chunk(4) == 10
    blocked = detached_norm(W, A, B, base_sq, 0.7, fused)
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=0)
    dense = (W + 0.7 * B @ A).double().norm(dim=1)
    torch.testing.assert_close(blocked.double(), dense, rtol=1e-5, atol=0)


def test_norm_row_chunk_bounds_u():
    assert config.norm_row_chunk(16) * 16 <= config.NORM_U_ELEMENTS
    assert config.norm_row_chunk(384) == 16384  # a Llama-8B MLP (14336) is one block
    assert config.norm_row_chunk(10**9) == 1


class _Pointer:
    """What ``launch_form`` reads of a pointer argument, for a CUDA tensor on a CPU machine."""

    def __init__(self, address: int, dtype=torch.bfloat16, is_cuda: bool = True):
        self.address, self.dtype, self.is_cuda = address, dtype, is_cuda

    def data_ptr(self) -> int:
        return self.address


def test_launch_form_key_is_never_coarser_than_tritons():
    def key(*args, options=(0, 4, None)):
        return launch_form(1, args, options)[0]

    p = _Pointer(4096)
    base = key(p, 32, 1.5, 64)
    assert key(_Pointer(8192), 32, 1.5, 64) == base  # another aligned address: the same kernel
    assert key(_Pointer(4098), 32, 1.5, 64) != base  # 16-byte alignment
    assert key(_Pointer(4096, torch.float32), 32, 1.5, 64) != base  # dtype
    assert key(_Pointer(4096, is_cuda=False), 32, 1.5, 64) != base  # a CPU tensor never hits
    assert key(p, 33, 1.5, 64) != base  # divisibility by 16
    assert key(p, 1, 1.5, 64) != key(p, 17, 1.5, 64)  # == 1 is specialised
    assert key(p, 2**31 + 16, 1.5, 64) != key(p, 16, 1.5, 64)  # int64 range
    assert key(p, 32, 1.5, 128) != base  # constexpr value
    assert key(p, 1, 1.5, 64) != key(p, True, 1.5, 64)  # an i1 argument is not an int
    assert key(p, 32, 2, 64) != key(p, 32, 2.0, 64)  # nor is a float
    assert key(p, 32, 1.5, 64, options=(0, 8, None)) != base  # options
    assert key(p, 32, 1.5, 64, options=(1, 4, None)) != base  # device


def test_launch_form_passes_addresses_for_pointers():
    x = torch.arange(6.0)
    _, args = launch_form(2, (x, x[1:], 7, 0.5, None), (0, 4, None))
    assert args == (x.data_ptr(), x.data_ptr() + 4, 7, 0.5, None)
    with pytest.raises(AttributeError):  # a pointer argument that is not a tensor
        launch_form(2, (x, None, 7, 0.5, None), (0, 4, None))


def _recording_launcher(monkeypatch, kernel_fn):
    """A ``Launcher`` on a stand-in kernel, its fast path on as on CUDA: ``calls`` records
    (``"triton"``, args) for ``kernel[grid](...)`` and (``"c"``, args) for the C launcher."""
    from dora_torch.kernels import launch

    calls = []

    class Compiled:
        function, packed_metadata = 1, None

        @staticmethod
        def run(*args):
            calls.append(("c", args[9:]))  # after grid, stream, function, metadata, hooks

    class Kernel:
        fn, __name__ = staticmethod(kernel_fn), kernel_fn.__name__

        def __getitem__(self, grid):
            return lambda *args, **options: calls.append(("triton", args)) or Compiled()

    monkeypatch.setattr(launch.config, "interpreting", lambda: False)
    monkeypatch.setattr(launch.config, "FAST_TRITON_LAUNCH", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    stream = types.SimpleNamespace(get_current_stream=lambda device: 0)
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=stream))
    return Launcher(Kernel()), calls


def test_launcher_hits_pass_addresses_and_unkeyable_calls_go_through_triton(monkeypatch):
    def kernel(a_ptr, b_ptr, n, s, BLOCK):
        pass

    launcher, calls = _recording_launcher(monkeypatch, kernel)
    x, y = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    for _ in range(2):
        launcher((1,), x, y, 4, 0.5, num_warps=4, BLOCK=16)
    assert calls == [("triton", (x, y, 4, 0.5, 16)),
                     ("c", (x.data_ptr(), y.data_ptr(), 4, 0.5, 16))]  # fmt: skip
    assert launcher.fast_launches == 1
    calls.clear()
    for _ in range(2):  # None for a pointer, a tensor for another parameter: never kept
        launcher((1,), x, None, 4, 0.5, num_warps=4, BLOCK=16)
        launcher((1,), x, y, x, 0.5, num_warps=4, BLOCK=16)
    assert [c[0] for c in calls] == ["triton"] * 4
    assert len(launcher._compiled) == 1
    with pytest.raises(TypeError, match="takes 5 arguments"):
        launcher((1,), x, y, 4, num_warps=4)


def test_launcher_needs_pointer_parameters_first():
    def kernel(a_ptr, n, b_ptr):
        pass

    with pytest.raises(ValueError, match=r"pointer parameters \(named \*_ptr\) first"):
        Launcher(types.SimpleNamespace(fn=kernel, __name__="kernel"))


def test_only_installed_launch_hooks_turn_the_fast_path_off():
    triton = pytest.importorskip("triton")
    chain = triton.knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton keeps launch hooks as plain callables")
    assert not hooks_set()  # the default: an empty chain

    def hook(*_args):
        return None

    chain.add(hook)
    try:
        assert hooks_set()
    finally:
        chain.remove(hook)
    assert not hooks_set()


def test_launcher_orders_named_parameters_and_names_missing_ones():
    launcher = Launcher(_launch_compose.kernel)
    assert launcher.names[launcher.pointers - 1 : launcher.pointers + 1] == (
        "inner_ptr",
        "stride_lm",
    )
    with pytest.raises(TypeError, match="BLOCK_N"):
        launcher((1,), *range(len(launcher.names) - 2), num_warps=4, BLOCK_M=16)


def test_launcher_passes_named_parameters_in_the_kernels_order_either_way(monkeypatch):
    launched = []

    class Recorder:  # kernel[grid](*args, **options), recorded instead of launched
        def __getitem__(self, grid):
            return lambda *args, **options: launched.append(args)

    launcher = Launcher(_launch_compose.kernel)
    launcher.kernel = Recorder()
    names = launcher.names
    k = names.index("EPS")  # the constexprs, from EPS on, go by name
    named = {n: 100 + i for i, n in enumerate(names[k:])}
    monkeypatch.setattr(config, "FAST_TRITON_LAUNCH", False)  # straight to kernel[grid]
    launcher((1,), *range(k), num_warps=4, **named)
    launcher((1,), *range(k), num_warps=4, **dict(reversed(named.items())))
    assert launched[0] == launched[1] == (*range(k), *named.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scaled_mm_is_one_scaled_product(dtype):
    torch.manual_seed(0)
    a, b = torch.randn(7, 5, dtype=dtype), torch.randn(5, 3, dtype=dtype)
    got = scaled_mm(a, b, 0.37, dtype)
    assert got.dtype == dtype
    want = (a.double() @ b.double()) * 0.37
    tol = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_scaled_mm_writes_the_compute_dtype_for_16_bit_inputs():
    a, b = torch.randn(6, 4).bfloat16(), torch.randn(4, 2).bfloat16()
    got = scaled_mm(a, b, 2.0, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, (a.float() @ b.float()) * 2.0, rtol=1e-2, atol=1e-2)


def _layer_grads(layer, x):
    x = x.detach().requires_grad_(True)
    y = layer(x)
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in (layer.lora_A, layer.lora_B, layer.lora_magnitude_vector)]
    layer.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@gpu
@pytest.mark.parametrize("offset", [0, 1])
def test_fast_launch_matches_triton_launch_on_gpu(monkeypatch, offset):
    """The launch cache runs the kernels Triton would (bitwise), including for a misaligned
    input, which needs its own specialisation."""
    torch.manual_seed(0)
    base = nn.Linear(96, 80, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = dora_torch.Linear.from_linear(base, r=8, lora_alpha=16, impl="fused")
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.05)
    flat = torch.randn(4 * 256 * 96 + offset, device="cuda", dtype=torch.bfloat16)
    x = flat[offset:].view(4, 256, 96)
    monkeypatch.setattr(config, "FAST_TRITON_LAUNCH", False)
    want = _layer_grads(layer, x)
    monkeypatch.setattr(config, "FAST_TRITON_LAUNCH", True)
    before = _launch_compose.fast_launches, layer._dora_norm_cache.norm_computations
    for _ in range(3):  # the first call of a key compiles through Triton, later ones hit
        got = _layer_grads(layer, x)
    from dora_torch.kernels.compose import _launch_lora_gemm_compose

    assert _launch_lora_gemm_compose.fast_launches > 0
    assert before[1] == layer._dora_norm_cache.norm_computations
    for g, w in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
        assert torch.equal(g, w)


def test_grid_helpers_match_tritons():
    """The launchers' plain-int ceil-division and next power of two (``triton.cdiv`` and
    ``triton.next_power_of_2`` cost host time per call in recent Triton)."""
    triton = pytest.importorskip("triton")
    from dora_torch.kernels.common import cdiv, next_pow2

    for a in range(0, 300):
        for b in (1, 2, 3, 16, 32, 64, 128, 257):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert next_pow2(n) == triton.next_power_of_2(n)


def test_linear_options_are_shared_per_value():
    from dora_torch.ops import LinearOptions

    a = LinearOptions.of(2.0, "fused", 2)
    assert a is LinearOptions.of(2.0, "fused", 2)
    assert a == LinearOptions(2.0, "fused", 2)
    assert LinearOptions.of(2.0, "eager", 2) is not a
    assert LinearOptions.of(2.0, "fused", 2, True) == LinearOptions(2.0, "fused", 2, True)


def _grads(layer, x):
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.square().sum().backward()
    params = (layer.lora_A, layer.lora_B, layer.lora_magnitude_vector)
    return [y.detach()] + [p.grad for p in params]


@pytest.mark.parametrize("impl", ["eager", "fused"])
def test_apply_linear_takes_autograds_c_entry_with_functions_results(monkeypatch, impl):
    """Eager calls skip ``Function.apply``'s Python (``ops.apply_linear``) and get the same
    output and gradients as through it, bit for bit."""
    from dora_torch import ops

    if impl == "fused" and not config.interpreting():
        pytest.skip("the fused tier on CPU needs the Triton interpreter")
    torch.manual_seed(0)
    layer = dora_torch.Linear.from_linear(nn.Linear(8, 6), r=2, lora_alpha=4, impl=impl)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(2, 3, 8)
    entered = []
    real = ops._C_APPLY
    monkeypatch.setattr(ops, "_C_APPLY", lambda *args: entered.append(1) or real(*args))
    fast = _grads(layer, x)
    assert entered, "the eager call did not take autograd's C entry"
    monkeypatch.setattr(ops, "_C_APPLY", ops.LinearFunction.apply)  # Function.apply's path
    slow = _grads(layer, x)
    assert len(entered) == 1
    for got, want in zip(fast, slow, strict=True):
        assert torch.equal(got, want)


def test_an_input_leaked_from_a_transform_computes_as_the_plain_tensor():
    """An input that escaped a ``torch.func`` transform (a wrapper of an exited level): the
    layer computes what it computes on the plain tensor, gradients included (its reshape
    unwraps it before ``apply_linear``, as ``Function.apply``'s scan would). Under an active
    transform ``Function.apply`` runs, and says why it cannot (the Function has no
    ``setup_context``)."""
    torch.manual_seed(0)
    layer = dora_torch.Linear.from_linear(nn.Linear(8, 6), r=2, lora_alpha=4, impl="eager")
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 8)
    leaked = []
    torch.func.grad(lambda t: leaked.append(t) or t.sum())(x.clone())
    assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])
    want = _grads(layer, x)
    got = _grads(layer, leaked[0])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.vmap(layer)(x[None])
