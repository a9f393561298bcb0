"""Stacked weights (``dora_torch.Linear(stack_weights=True)``, ``dora_torch.stacking``): the
one-GEMM paths give the two-GEMM paths' results, the stacked rows are never stale (every
optimizer kind, ``to()``, ``load_state_dict``, merges), a pending backward whose a was
rewritten is refused, and every case the stacked paths do not serve falls back to them.

The fused tier runs through the Triton interpreter here (tests/conftest.py)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import dora_torch
from dora_torch import config, ops
from dora_torch.kernels.backward import scale_reduce

from .helpers import uncached_output
from .test_cache import OPTIMIZERS

D_IN, D_OUT, R, TOKENS = 32, 24, 4, 12


@pytest.fixture(autouse=True, params=[False, True], ids=["plain_fwd", "stacked_fwd"])
def stack_forward(request, monkeypatch):
    """Every test in both forms: the backward's one dx GEMM alone (``config.STACK_FORWARD``
    off, the default) and the forward's one x Fᵀ GEMM too."""
    monkeypatch.setattr(config, "STACK_FORWARD", request.param)
    return request.param


def _pair(
    *, dtype=torch.float32, adapter_dtype=None, bias=False, seed=0, impl="fused",
    device="cpu", d_in=D_IN, d_out=D_OUT, r=R, **kw,
):  # fmt: skip
    """(reference, stacked): the same layer twice, B nonzero, one of them stacked."""
    torch.manual_seed(seed)
    base = nn.Linear(d_in, d_out, bias=bias).to(device=device, dtype=dtype)
    opts = dict(r=r, lora_alpha=8, impl=impl, adapter_dtype=adapter_dtype, **kw)
    ref = dora_torch.Linear.from_linear(copy.deepcopy(base), **opts)
    stk = dora_torch.Linear.from_linear(copy.deepcopy(base), stack_weights=True, **opts)
    with torch.no_grad():
        ref.lora_B.normal_()
        stk.lora_B.copy_(ref.lora_B)
        stk.lora_A.copy_(ref.lora_A)
    return ref, stk


def _stacked_output(y: torch.Tensor, layer) -> bool:
    """Whether y was written over the stacked product [T, d_out + r] (no bias)."""
    rows = y.numel() // layer.out_features
    width = layer.out_features + layer.r
    return y.untyped_storage().nbytes() == rows * width * y.element_size()


class _BackwardSpy:
    """Records whether each ``ops.backward_core`` call got stacked weights."""

    def __init__(self, monkeypatch):
        self.stacked = []
        real = ops.backward_core

        def spy(*args, **kwargs):
            self.stacked.append(kwargs.get("stacked") is not None)
            return real(*args, **kwargs)

        monkeypatch.setattr(ops, "backward_core", spy)


def _ulp_close(actual, expected, name, ulps=2, dtype=None):
    """|actual − expected| within ``ulps`` units of rounding at the largest |expected|, in
    ``dtype`` (default expected's; fp32: 2^-23, bf16: 2^-7 relative): the stacked GEMMs
    round once where the two-GEMM path rounds twice, and nothing else differs."""
    eps = torch.finfo(dtype or expected.dtype).eps
    actual, expected = actual.detach().float(), expected.detach().float()
    scale = float(expected.abs().max())
    err = float((actual - expected).abs().max())
    assert err <= ulps * eps * scale, f"{name}: {err} > {ulps} ulp of {scale}"


CASES = {
    "fp32": dict(dtype=torch.float32),
    "fp32_bias": dict(dtype=torch.float32, bias=True),
    "bf16_fp32_adapters": dict(dtype=torch.bfloat16),
    "bf16_bf16_adapters": dict(dtype=torch.bfloat16, adapter_dtype=torch.bfloat16),
}


def _check_against_two_gemms(ref, stk, x, spy, bias):
    """The stacked layer's forward and gradients by the project's rule (shared_spec.
    tolerances): against a float64 copy of the layer (eager tier), no worse than twice the
    two-GEMM layer's error in the same dtype."""
    from shared_spec.tolerances import assert_close

    ref64 = copy.deepcopy(ref).double()
    ref64.impl = "eager"
    xs = [x.clone().requires_grad_() for _ in range(2)] + [x.double().requires_grad_()]
    ys = [layer(xi) for layer, xi in zip((ref, stk, ref64), xs, strict=True)]
    assert bias or _stacked_output(ys[1], stk) == config.STACK_FORWARD
    dy = torch.randn_like(ys[0])
    for y in ys:
        y.backward(dy.to(y.dtype))
    assert spy.stacked == [False, True, False]

    def arr(t):
        return t.detach().double().cpu().numpy()

    eps = torch.finfo(x.dtype).eps
    got = {"y": ys, "dx": [xi.grad for xi in xs]}
    for name in ("lora_A", "lora_B", "lora_magnitude_vector"):
        got[name] = [getattr(layer, name).grad for layer in (ref, stk, ref64)]
    for name, (baseline, actual, reference) in got.items():
        assert_close(arr(actual), arr(reference), arr(baseline), machine_eps=eps, name=name)


@pytest.mark.parametrize("case", list(CASES))
def test_stacked_forward_and_gradients_match_the_two_gemm_paths(case, monkeypatch):
    spec = CASES[case]
    ref, stk = _pair(**spec)
    x = torch.randn(3, 4, D_IN, dtype=spec["dtype"])
    _check_against_two_gemms(ref, stk, x, _BackwardSpy(monkeypatch), spec.get("bias"))


@pytest.mark.parametrize(("tokens", "r"), [(0, 4), (1, 1), (7, 1), (5, 17)])
def test_stacked_paths_on_edge_shapes(tokens, r, monkeypatch):
    """No tokens, one token, rank 1 (a single stacked row) and a rank past one block, in bf16
    with fp32 adapters (the cast rows) and with a bias (inner saved), by the same rule."""
    ref, stk = _pair(dtype=torch.bfloat16, bias=True, r=r, d_in=40, d_out=28)
    x = torch.randn(tokens, 40, dtype=torch.bfloat16)
    _check_against_two_gemms(ref, stk, x, _BackwardSpy(monkeypatch), bias=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_stacked_forward_and_gradients_match_the_two_gemm_paths(case, monkeypatch):
    """cuBLAS and the compiled kernels, on shapes that are no multiple of any block."""
    spec = CASES[case]
    ref, stk = _pair(device="cuda", d_in=136, d_out=200, r=12, **spec)
    x = torch.randn(3, 101, 136, device="cuda", dtype=spec["dtype"])
    _check_against_two_gemms(ref, stk, x, _BackwardSpy(monkeypatch), spec.get("bias"))


@pytest.mark.gpu
def test_cuda_graph_replays_the_stacked_step():
    """fwd+bwd captured in one CUDA graph (``bench_torch_layer``'s graphed rows), the norm
    recomputed inside: each replay gives the eager step's gradients for the current A."""
    ref, stk = _pair(device="cuda", dtype=torch.bfloat16, adapter_dtype=torch.bfloat16,
                     d_in=256, d_out=192, r=16)  # fmt: skip
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(64, 192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            stk(x).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    dora_torch.clear_caches(stk)
    stk._dora_norm_cache.base_sq(stk.weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stk(x).backward(dy)
    for _ in range(2):
        with torch.no_grad():
            stk.lora_A.add_(0.01 * torch.randn_like(stk.lora_A))
            ref.lora_A.copy_(stk.lora_A)
        for p in (*stk.parameters(), *ref.parameters()):
            if p.grad is not None:
                p.grad.zero_()
        graph.replay()
        ref(x).backward(dy)
        torch.cuda.synchronize()
        for name in ("lora_A", "lora_B", "lora_magnitude_vector"):
            _ulp_close(getattr(stk, name).grad, getattr(ref, name).grad, name, ulps=4)


def test_the_backward_alone_can_be_stacked(monkeypatch):
    """``config.STACK_FORWARD`` off: the forward's two GEMMs (a contiguous y), the backward's
    one dx GEMM, the same results."""
    monkeypatch.setattr(config, "STACK_FORWARD", False)
    ref, stk = _pair(dtype=torch.bfloat16)
    spy = _BackwardSpy(monkeypatch)
    x = torch.randn(TOKENS, D_IN, dtype=torch.bfloat16)
    x_ref, x_stk = (x.clone().requires_grad_() for _ in range(2))
    y_ref, y_stk = ref(x_ref), stk(x_stk)
    assert y_stk.is_contiguous() and not _stacked_output(y_stk, stk)
    torch.testing.assert_close(y_stk, y_ref, rtol=0, atol=0)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y_stk.backward(dy)
    assert spy.stacked == [False, True]
    _ulp_close(x_stk.grad, x_ref.grad, "dx")
    for name in ("lora_A", "lora_B", "lora_magnitude_vector"):
        _ulp_close(getattr(stk, name).grad, getattr(ref, name).grad, name, ulps=4)


def test_no_grad_calls_touch_the_stack_only_when_the_forward_reads_it(monkeypatch):
    """Without grad the backward's F is never needed: with ``STACK_FORWARD`` off an inference
    call neither views F nor writes its cast rows."""
    from dora_torch.stacking import StackedWeights

    _, layer = _pair(dtype=torch.bfloat16)
    views = []
    real = StackedWeights.buffer
    monkeypatch.setattr(StackedWeights, "buffer", lambda s, w: views.append(1) or real(s, w))
    with torch.no_grad():
        y = layer(torch.randn(TOKENS, D_IN, dtype=torch.bfloat16))
    assert len(views) == int(config.STACK_FORWARD)
    assert _stacked_output(y, layer) == config.STACK_FORWARD


def test_zero_magnitude_rows_recover_through_the_stacked_h():
    """SAVE_RECOVER's columns with g = 0 recompute inner from h, a column view of the stacked
    product (row stride d_out + r) in the scale-and-reduce kernel."""
    ref, stk = _pair()
    with torch.no_grad():
        for layer in (ref, stk):
            layer.lora_magnitude_vector[:5] = 0.0
    x = torch.randn(TOKENS, D_IN)
    dy = torch.randn(TOKENS, D_OUT)
    ref(x).backward(dy)
    stk(x).backward(dy)
    dm_ref = ref.lora_magnitude_vector.grad
    assert float(dm_ref[:5].abs().min()) > 0  # the recomputed columns carry a gradient
    _ulp_close(stk.lora_magnitude_vector.grad, dm_ref, "dm", ulps=8)


def test_the_weight_parameter_keeps_its_identity_and_values():
    torch.manual_seed(0)
    linear = nn.Linear(D_IN, D_OUT, bias=False)
    before = linear.weight.detach().clone()
    layer = dora_torch.Linear.from_linear(linear, r=R, lora_alpha=8, stack_weights=True)
    stack = layer._dora_stack
    assert layer.weight is linear.weight
    assert layer.weight.data_ptr() == stack.buffer(layer.weight).data_ptr()
    torch.testing.assert_close(layer.weight.detach(), before, rtol=0, atol=0)
    assert list(layer.state_dict()) == list(
        dora_torch.Linear.from_linear(
            nn.Linear(D_IN, D_OUT, bias=False), r=R, lora_alpha=8
        ).state_dict()
    )
    assert "stack_weights=True" in repr(layer)


@pytest.mark.parametrize("adapter_dtype", [None, torch.bfloat16], ids=["fp32_A", "bf16_A"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_every_optimizer_step_reaches_the_stacked_rows(kind, adapter_dtype):
    _, layer = _pair(dtype=torch.bfloat16, adapter_dtype=adapter_dtype)
    assert layer._dora_stack.owns_a == (adapter_dtype is not None)
    opt = OPTIMIZERS[kind]([p for p in layer.parameters() if p.requires_grad])
    x = torch.randn(8, D_IN, dtype=torch.bfloat16)
    for _ in range(3):
        opt.zero_grad()
        layer(x).float().pow(2).mean().backward()
        opt.step()
        y = layer(x)
        assert _stacked_output(y, layer) == config.STACK_FORWARD
        # the two-GEMM path on the same parameters, nothing cached
        _ulp_close(y, uncached_output(layer, x, impl="fused"), "y after a step")
        cast = layer.lora_A.detach().to(torch.bfloat16)
        rows = layer._dora_stack.buffer(layer.weight)[D_OUT:]
        torch.testing.assert_close(rows, cast, rtol=0, atol=0)


def test_a_pending_backward_whose_a_was_rewritten_is_refused():
    """An update of A between a forward and its backward rewrites the stacked rows (fp32 A:
    the next forward's cast; bf16 A: the optimizer itself): autograd refuses the backward,
    as it does for PEFT's saved A."""
    for adapter_dtype in (None, torch.bfloat16):
        _, layer = _pair(dtype=torch.bfloat16, adapter_dtype=adapter_dtype)
        opt = torch.optim.AdamW([layer.lora_A], lr=0.1, foreach=True)
        x = torch.randn(8, D_IN, dtype=torch.bfloat16)
        pending = layer(x).float().sum()
        layer(x).float().sum().backward()
        opt.step()
        layer(x)  # a new entry: fp32 A's cast is written into the rows
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            pending.backward()


def test_to_restacks_and_releases_the_old_buffer():
    _, layer = _pair()
    old = layer._dora_stack._storage  # a weak reference
    layer.to(torch.bfloat16)
    gc.collect()
    assert old() is None
    stack = layer._dora_stack
    assert stack.holds(layer.weight, layer.lora_A) and layer.weight.dtype == torch.bfloat16
    assert stack.owns_a
    x = torch.randn(TOKENS, D_IN, dtype=torch.bfloat16)
    y = layer(x)
    assert _stacked_output(y, layer) == config.STACK_FORWARD
    _ulp_close(y, uncached_output(layer, x, impl="fused"), "y after to()")


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_pickled_or_copied_stacked_layer_restacks(how, tmp_path):
    import copy

    _, layer = _pair()
    x = torch.randn(TOKENS, D_IN)
    want = layer(x).detach()
    if how == "deepcopy":
        twin = copy.deepcopy(layer)
    else:
        torch.save(layer, tmp_path / "layer.pt")
        twin = torch.load(tmp_path / "layer.pt", weights_only=False)
    assert twin._dora_stack.holds(twin.weight, twin.lora_A)
    assert not layer._dora_stack.holds(twin.weight, twin.lora_A)  # a buffer of its own
    y = twin(x)
    assert _stacked_output(y, twin) == config.STACK_FORWARD
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_the_stack_holds_no_buffer_of_its_own():
    """W and A given new storage behind the module's back: the old buffer is freed with
    them (the stack keeps a weak reference), and calls take the two-GEMM path."""
    _, layer = _pair()
    old = layer._dora_stack._storage
    layer.weight.data = layer.weight.data.clone()
    layer.lora_A.data = layer.lora_A.data.clone()
    gc.collect()
    assert old() is None
    assert not layer._dora_stack.holds(layer.weight, layer.lora_A)
    x = torch.randn(TOKENS, D_IN)
    y = layer(x)
    assert not _stacked_output(y, layer)
    _ulp_close(y, uncached_output(layer, x, impl="fused"), "y after the move", ulps=4)


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_keeps_the_rows_current(assign):
    ref, layer = _pair()
    with torch.no_grad():
        ref.weight.mul_(0.5)
        ref.lora_A.normal_()
    layer.load_state_dict(ref.state_dict(), assign=assign)
    stack = layer._dora_stack
    assert stack.holds(layer.weight, layer.lora_A)
    torch.testing.assert_close(
        stack.buffer(layer.weight)[:D_OUT], ref.weight.detach(), rtol=0, atol=0
    )
    x = torch.randn(TOKENS, D_IN)
    y = layer(x)
    assert _stacked_output(y, layer) == config.STACK_FORWARD
    _ulp_close(y, ref(x), "y after load_state_dict")


def test_merge_and_unmerge_write_through_the_stack():
    _, layer = _pair()
    x = torch.randn(TOKENS, D_IN)
    y0 = layer(x).detach()
    layer.merge()
    assert layer._dora_stack.holds(layer.weight, layer.lora_A)
    _ulp_close(layer(x), y0, "merged", ulps=16)
    layer.unmerge()
    y1 = layer(x)
    assert _stacked_output(y1, layer) == config.STACK_FORWARD
    _ulp_close(y1, y0, "unmerged", ulps=16)


@pytest.mark.parametrize(
    "change",
    ["dropout", "recompute_inner", "eager", "autocast", "moved_weight"],
)
def test_calls_the_stacked_paths_do_not_serve_take_the_two_gemm_paths(change, monkeypatch):
    kw = {
        "dropout": dict(lora_dropout=0.25),
        "recompute_inner": dict(recompute_inner=True),
        "eager": dict(impl="eager"),
    }.get(change, {})
    _, layer = _pair(**kw)
    x = torch.randn(TOKENS, D_IN)
    if change == "moved_weight":  # a new storage that _apply did not see: no stacked path
        layer.weight.data = layer.weight.data.clone()
    spy = _BackwardSpy(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=change == "autocast"):
        y = layer(x)
        y.float().sum().backward()
        want = None if change == "dropout" else uncached_output(layer, x, impl=layer.impl)
    assert spy.stacked == [False]
    assert not _stacked_output(y, layer)
    if want is not None:
        _ulp_close(y, want, "y", ulps=4)


def test_a_bad_stack_weights_changes_nothing():
    linear = nn.Linear(D_IN, D_OUT)
    storage = linear.weight.data_ptr()
    with pytest.raises(TypeError, match="stack_weights must be a bool"):
        dora_torch.Linear.from_linear(linear, r=R, lora_alpha=8, stack_weights=1)
    assert linear.weight.requires_grad and linear.weight.data_ptr() == storage


def test_stacked_paths_refuse_what_they_do_not_compute():
    x = torch.randn(4, D_IN)
    w = torch.randn(D_OUT, D_IN)
    a, b = torch.randn(R, D_IN), torch.randn(D_OUT, R)
    m, n = torch.ones(D_OUT), torch.ones(D_OUT)
    stacked = torch.cat([w, a])
    for impl, x_d, save in (("eager", None, ops.SAVE_INNER), ("fused", x, ops.SAVE_INNER),
                            ("fused", None, ops.SAVE_RECOMPUTE)):  # fmt: skip
        opts = ops.LinearOptions(2.0, impl, save)
        with pytest.raises(ValueError, match="stacked weights need impl='fused'"):
            ops.forward_core(x, x_d, w, a, b, m, n, None, opts, stacked)
    dy = torch.randn(4, D_OUT)
    with pytest.raises(ValueError, match="out must be a"):
        scale_reduce(dy, dy, m, n, recover=False, dropout=False, need_dbias=False,
                     out=torch.empty(4, D_OUT + 1)[:, 1:].t().t()[:3])  # fmt: skip
    with pytest.raises(ValueError, match="without dropout"):
        scale_reduce(dy, dy, m, n, recover=False, dropout=True, need_dbias=False,
                     out=torch.empty(4, D_OUT))  # fmt: skip


def test_compiled_graphs_run_a_stacked_layer_without_graph_breaks():
    """Compiled graphs take the two-GEMM path (the stack serves eager calls): a stacked
    module compiles whole, in training and eval (the eager tier: CPU graphs cannot run the
    interpreted kernels, tests/torch/test_compile.py)."""
    ref, layer = _pair(impl="eager")
    x = torch.randn(TOKENS, D_IN)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    ref(x).sum().backward()
    _ulp_close(y, ref(x), "compiled y", ulps=4)
    _ulp_close(layer.lora_A.grad, ref.lora_A.grad, "compiled dA", ulps=8)
    layer.eval()
    ref.eval()
    with torch.no_grad():
        _ulp_close(compiled(x), ref(x), "compiled eval y", ulps=4)


def test_the_constructor_stacks_and_inference_mode_calls_take_the_stacked_path():
    torch.manual_seed(0)
    layer = dora_torch.Linear(
        D_IN, D_OUT, r=R, lora_alpha=8, bias=False, dtype=torch.bfloat16, impl="fused",
        stack_weights=True,
    )  # fmt: skip
    assert not layer._dora_stack.owns_a  # fp32 adapters on a bf16 base: F holds their cast
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(TOKENS, D_IN, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = layer(x)
    assert _stacked_output(y, layer) == config.STACK_FORWARD
    _ulp_close(y, uncached_output(layer, x, impl="fused"), "y under inference_mode")


# --------------------------------------------------------------- accelerate_peft, inject
#: base dtype, PEFT's autocast_adapter_dtype (True: fp32 adapters on a bf16 base)
PEFT_SETTINGS = {
    "fp32": (torch.float32, True),
    "bf16_fp32_adapters": (torch.bfloat16, True),
    "bf16_bf16_adapters": (torch.bfloat16, False),
}


def _peft_llama(setting="fp32"):
    """A tiny transformers Llama under PEFT DoRA on every projection, adapters randomized."""
    from peft import LoraConfig, get_peft_model

    from tests.parity.models import ALL_PROJ, randomize_dora, tiny_llama

    dtype, autocast = PEFT_SETTINGS[setting]
    config = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=ALL_PROJ)
    model = get_peft_model(tiny_llama().to(dtype), config, autocast_adapter_dtype=autocast)
    randomize_dora(model)
    return model.train()


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids).logits.float().square().mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("setting", list(PEFT_SETTINGS))
def test_accelerate_peft_stacks_the_selected_layers(setting, monkeypatch):
    ref = _peft_llama(setting)
    model = copy.deepcopy(ref)
    dora_torch.accelerate_peft(ref, impl="fused")
    dora_torch.accelerate_peft(model, impl="fused", stack_modules=["q_proj", "down_proj"])
    report = model.dora_acceleration_report
    assert (
        sorted(n.rsplit(".", 1)[-1] for n in report.stacked) == ["down_proj"] * 2 + ["q_proj"] * 2
    )
    assert "4 with stacked weights" in str(report)
    owns = {m._dora_stack.owns_a for m in model.modules() if m.__dict__.get("_dora_stack")}
    assert owns == {setting != "bf16_fp32_adapters"}
    spy = _BackwardSpy(monkeypatch)
    ids = torch.randint(0, 64, (2, 5))
    loss_ref, grads_ref = _loss_and_grads(ref, ids)
    stacked_calls = sum(spy.stacked)
    loss, grads = _loss_and_grads(model, ids)
    assert sum(spy.stacked) - stacked_calls == 4  # q and down of both decoder layers
    # dx's one rounding instead of two reaches every earlier layer's gradients: judged in
    # the activation dtype
    dtype = PEFT_SETTINGS[setting][0]
    _ulp_close(loss, loss_ref, "loss", ulps=8, dtype=dtype)
    for name, g in grads_ref.items():
        _ulp_close(grads[name], g, name, ulps=8, dtype=dtype)


def test_recomputed_layers_keep_the_two_gemm_path_beside_stacked_ones(monkeypatch):
    """``recompute_modules`` and ``stack_modules`` together (``bench_model_torch``'s
    ``ours_recompute_stacked_bf16``): the recomputed layers' backward is not stacked, the
    others' is, and the model's gradients are the plain accelerated model's."""
    ref = _peft_llama()
    model = copy.deepcopy(ref)
    dora_torch.accelerate_peft(ref, impl="fused", recompute_modules=["q_proj"])
    dora_torch.accelerate_peft(
        model, impl="fused", recompute_modules=["q_proj"], stack_modules=".*"
    )  # fmt: skip
    spy = _BackwardSpy(monkeypatch)
    ids = torch.randint(0, 64, (2, 5))
    _, grads_ref = _loss_and_grads(ref, ids)
    before = len(spy.stacked)
    _, grads = _loss_and_grads(model, ids)
    assert sum(spy.stacked[before:]) == 12 and len(spy.stacked) - before == 14  # 2 × (7 − q)
    for name, g in grads_ref.items():
        _ulp_close(grads[name], g, name, ulps=8)


def test_accelerate_peft_restacks_after_to_and_validates_its_selection():
    model = _peft_llama()
    with pytest.raises(ValueError, match="stack_modules"):
        dora_torch.accelerate_peft(model, stack_modules=["lm_head"])
    assert not any("_dora_stack" in m.__dict__ for m in model.modules())  # untouched
    dora_torch.accelerate_peft(model, impl="fused", stack_modules=".*")
    layers = [m for m in model.modules() if m.__dict__.get("_dora_stack") is not None]
    assert len(layers) == 14
    layer = layers[0]
    old = layer._dora_stack._storage
    model.to(torch.bfloat16)
    gc.collect()
    assert old() is None  # the old buffer went with the old weights
    weight, lora_A = layer.base_layer.weight, layer.lora_A["default"].weight
    assert not layer._dora_stack.holds(weight, lora_A)
    dora_torch.accelerate_peft(model, impl="fused", stack_modules=".*")  # re-stacks
    assert layer._dora_stack.holds(weight, lora_A) and layer._dora_stack.owns_a
    dora_torch.restore_peft(model)
    assert not any("_dora_stack" in m.__dict__ for m in model.modules())


def test_inject_builds_the_selected_layers_stacked():
    from dora_torch.interop import dora_layers
    from tests.parity.models import tiny_llama

    model = tiny_llama()
    with pytest.raises(ValueError, match="stack_modules"):
        dora_torch.inject(
            model, target_modules=["q_proj"], r=4, lora_alpha=8, stack_modules=["v_proj"]
        )  # fmt: skip
    assert not dora_layers(model)
    dora_torch.inject(
        model, target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8, stack_modules=["v_proj"]
    )  # fmt: skip
    flags = {n.rsplit(".", 1)[-1]: m._dora_stack is not None for n, m in dora_layers(model).items()}
    assert flags == {"q_proj": False, "v_proj": True}


def test_adapter_files_and_state_dicts_round_trip_from_stacked_models(tmp_path):
    """W and A sharing one storage save and load as before: PEFT's ``save_pretrained`` /
    ``from_pretrained``, dora_torch's PEFT-format files, and a torch state dict."""
    from peft import PeftModel

    from dora_torch.interop.adapter_io import load_adapter, save_adapter
    from tests.parity.models import tiny_llama, token_ids

    ids = token_ids(tiny_llama().config)
    peft_model = _peft_llama().eval()
    dora_torch.accelerate_peft(peft_model, impl="fused", stack_modules=".*")
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path / "peft")
    back = PeftModel.from_pretrained(tiny_llama(), tmp_path / "peft").eval()
    with torch.no_grad():
        _ulp_close(back(input_ids=ids).logits, want, "PEFT reload", ulps=64)

    model = tiny_llama()
    dora_torch.inject(model, target_modules=["q_proj", "down_proj"], r=4, lora_alpha=8,
                      stack_modules=".*")  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
        want = model(input_ids=ids).logits
    save_adapter(model, tmp_path / "ours")
    again = load_adapter(tiny_llama(), tmp_path / "ours")
    torch.save(model.state_dict(), tmp_path / "state.pt")
    third = tiny_llama()
    dora_torch.inject(third, target_modules=["q_proj", "down_proj"], r=4, lora_alpha=8)
    third.load_state_dict(torch.load(tmp_path / "state.pt"))
    with torch.no_grad():
        for name, other in (("adapter file", again), ("state dict", third)):
            _ulp_close(other(input_ids=ids).logits, want, name, ulps=64)
