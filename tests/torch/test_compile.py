"""torch.compile(fullgraph=True) over the one autograd path, on the CPU (eager tier).

The fused tier's Triton kernels run through the interpreter here, which Dynamo cannot trace;
``test_compile_gpu.py`` compiles the fused tier on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import dora_torch

from .helpers import random_case_tensors, uncached_output


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compile_fullgraph_functional(exact, dtype):
    torch._dynamo.reset()
    x, W, A, B, m, b, s = (
        t.to(dtype) if isinstance(t, torch.Tensor) else t
        for t in random_case_tensors(22, lead=(2, 3))
    )

    def f(x, A, B, m):
        return dora_torch.dora_linear(x, W, A, B, m, s, b, impl="eager", exact_norm_grad=exact)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_(True) for t in (x, A, B, m)]
    leaves2 = [t.clone().requires_grad_(True) for t in (x, A, B, m)]
    y = compiled(*leaves)
    y_ref = f(*leaves2)
    torch.testing.assert_close(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    for a, r in zip(leaves, leaves2):
        torch.testing.assert_close(a.grad, r.grad)


def test_compile_fullgraph_recompute_inner():
    """The recomputing backward (ops.SAVE_RECOMPUTE) traces into one graph and gives the
    eager call's gradients."""
    torch._dynamo.reset()
    x, W, A, B, m, b, s = random_case_tensors(23, lead=(2, 3))

    def f(x, A, B, m):
        return dora_torch.dora_linear(x, W, A, B, m, s, b, impl="eager", recompute_inner=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_(True) for t in (x, A, B, m)]
    leaves2 = [t.clone().requires_grad_(True) for t in (x, A, B, m)]
    compiled(*leaves).square().sum().backward()
    f(*leaves2).square().sum().backward()
    for a, r in zip(leaves, leaves2):
        torch.testing.assert_close(a.grad, r.grad)


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    layer = dora_torch.Linear(24, 20, r=4, lora_alpha=8, impl="eager", **kw)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.3)
    return layer


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_compile_fullgraph_module_train_and_eval(dropout):
    torch._dynamo.reset()
    layer = _layer(lora_dropout=dropout)
    x = torch.randn(3, 24)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    layer.eval()
    torch.testing.assert_close(compiled(x), layer(x))
    layer.train()
    torch.manual_seed(1)
    y = compiled(x)
    torch.manual_seed(1)
    y_ref = layer(x)
    torch.testing.assert_close(y, y_ref)


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_eval_reads_a_norm_refreshed_by_every_optimizer_step(fused):
    """Train eagerly with an optimizer that does not bump version counters (fused AdamW),
    evaluate through a compiled graph in between: the graph must see the current norm."""
    torch._dynamo.reset()
    layer = _layer()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    params = [p for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.05, fused=fused)
    x = torch.randn(5, 24)
    for _ in range(3):
        layer.train()
        opt.zero_grad()
        layer(x).square().mean().backward()
        opt.step()
        layer.eval()
        with torch.no_grad():
            y = compiled(x)
            want = uncached_output(layer, x)
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)


def test_compiled_eval_after_load_state_dict_and_clear_caches():
    torch._dynamo.reset()
    layer, other = _layer(0), _layer(1)
    layer.eval()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 24)
    with torch.no_grad():
        compiled(x)
        layer.load_state_dict(other.state_dict())
        torch.testing.assert_close(compiled(x), uncached_output(layer, x))
        layer.lora_B.data.mul_(1.5)  # bypasses version counters and torch.optim
        # The documented limitation, which also proves the graph reads the buffer: stale
        # until clear_caches.
        assert not torch.allclose(compiled(x), uncached_output(layer, x))
        dora_torch.clear_caches(layer)
        torch.testing.assert_close(compiled(x), uncached_output(layer, x))
        # Dynamo burns version counters in as constants: an ordinary in-place write (which
        # eager calls do see) is invisible to a compiled eval graph too, until an eager call
        # or clear_caches refreshes the buffer (docs/design.md §8, rule 5).
        layer.lora_B.mul_(1.5)
        assert not torch.allclose(compiled(x), uncached_output(layer, x))
        torch.testing.assert_close(layer(x), uncached_output(layer, x))  # eager: refreshed
        torch.testing.assert_close(compiled(x), uncached_output(layer, x))


@pytest.mark.parametrize("train", [False, True])
def test_compile_fullgraph_under_autocast(train):
    """Under autocast the module must not touch its Python-side cache inside the graph."""
    torch._dynamo.reset()
    layer = _layer().train(train)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = compiled(x)
        y_ref = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref)


@pytest.mark.parametrize("train", [False, True])
def test_compile_fullgraph_accelerated_peft_layer(train):
    """A PEFT layer under accelerate_peft traces with no graph break (its fast-path checks
    included) and computes what it computes eagerly."""
    pytest.importorskip("peft")
    from tests.parity.models import peft_dora, tiny_llama

    torch._dynamo.reset()
    pm = peft_dora(tiny_llama(), target_modules=["q_proj"])
    dora_torch.accelerate_peft(pm, impl="eager")
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    layer.train(train)
    x = torch.randn(2, 5, 32, requires_grad=train)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    torch.testing.assert_close(y, layer(x))
    assert layer.last_impl == "eager"
    if train:
        y.square().sum().backward()
        grads = [p.grad.clone() for p in layer.parameters() if p.requires_grad]
        layer.zero_grad()
        layer(x).square().sum().backward()
        for g, p in zip(grads, [p for p in layer.parameters() if p.requires_grad], strict=True):
            torch.testing.assert_close(g, p.grad)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_compiled_backward_accumulates_dx_in_place(dropout):
    """dx = dy_g W + s·t A: functionalization would turn the in-place ``addmm_`` into an
    out-of-place ``addmm``, which ATen runs as a copy of the first product plus the GEMM.
    The compiled backward must call the mutating op instead (Inductor keeps it in place),
    with the eager gradients."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    layer = _layer(lora_dropout=dropout)
    x = torch.randn(6, 24, requires_grad=True)
    backend = AotEagerAndRecordGraphs()
    torch.manual_seed(1)
    torch.compile(layer, fullgraph=True, backend=backend)(x).square().sum().backward()
    got = [t.grad.clone() for t in (x, layer.lora_A, layer.lora_B, layer.lora_magnitude_vector)]
    for t in (x, layer.lora_A, layer.lora_B, layer.lora_magnitude_vector):
        t.grad = None
    torch.manual_seed(1)
    layer(x).square().sum().backward()
    want = [t.grad for t in (x, layer.lora_A, layer.lora_B, layer.lora_magnitude_vector)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    (bw,) = backend.bw_graphs
    code = bw.code
    assert "dora_torch.addmm_into" in code
    assert "aten.addmm." not in code


@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.float64])
def test_compiled_backward_forms_each_adapter_gradient_in_one_op(adapter_dtype):
    """dA = s·tᵀ x and dB = s·dy_gᵀ h are one scaled GEMM each in the compiled backward
    too (``dora_torch::scaled_mm``), not a GEMM plus a scale-and-cast pass, and give the
    eager gradients bit for bit (the same code runs)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = dora_torch.Linear(24, 20, r=4, lora_alpha=6, impl="eager", adapter_dtype=adapter_dtype)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.3)
    x = torch.randn(6, 24)
    backend = AotEagerAndRecordGraphs()
    torch.compile(layer, fullgraph=True, backend=backend)(x).square().sum().backward()
    got = [layer.lora_A.grad.clone(), layer.lora_B.grad.clone()]
    layer.zero_grad(set_to_none=True)
    layer(x).square().sum().backward()
    assert torch.equal(got[0], layer.lora_A.grad) and torch.equal(got[1], layer.lora_B.grad)
    (bw,) = backend.bw_graphs
    assert bw.code.count("dora_torch.scaled_mm") == 2


def _compiled_train_graphs(layer, x):
    """(compiled training output, its forward graph's code) of ``layer`` on ``x``."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    backend = AotEagerAndRecordGraphs()
    y = torch.compile(layer, fullgraph=True, backend=backend)(x)
    return y, "\n".join(g.code for g in backend.fw_graphs)


def _compiled_steps_match_uncached(layer, x, steps=3):
    """Yields the forward graph code of each of ``steps`` compiled AdamW training steps of
    ``layer`` on ``x``, after checking its output against an uncached eager call."""
    opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        y, code = _compiled_train_graphs(layer, x)
        torch.testing.assert_close(y, uncached_output(layer, x), rtol=1e-6, atol=1e-6)
        yield code
        y.square().mean().backward()
        opt.step()


def _fused_layer():
    """A layer of the fused tier (the interpreter's kernels, which Dynamo cannot trace)."""
    layer = _layer()
    layer.impl = "fused"
    return layer


@pytest.mark.parametrize("when", ["auto", "inference", "forward", "always"])
def test_compiled_inference_composes_with_torch_ops(when):
    """``config.COMPILED_TORCH_COMPOSE`` (any value but "never"): a fused-tier
    layer's compiled eval forward reads the norm buffer and runs the products and the
    composition as torch ops (no Triton kernel in the graph: one could not be traced here),
    and gives the uncached fused output. The trace asks ``compiled_tier`` with the layer's
    rank."""
    from dora_torch import config, functional

    asked = []

    def recorded(needs_grad, rank):
        asked.append((needs_grad, rank))
        return compiled_tier(needs_grad, rank)

    compiled_tier = functional.compiled_tier
    torch._dynamo.reset()
    x = torch.randn(5, 24)
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(config, "COMPILED_TORCH_COMPOSE", when)
        patch.setattr(functional, "compiled_tier", recorded)
        layer = _fused_layer().eval()
        y, code = _compiled_train_graphs(layer, x)
    assert "triton" not in code and "sqrt" not in code  # the norm: read from its buffer
    assert asked == [(False, layer.r)]
    torch.testing.assert_close(y, uncached_output(layer, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("when", "needs_grad", "rank", "want"),
    [
        ("auto", False, 512, ("eager", False)),
        ("auto", True, 383, ("fused", False)),
        ("auto", True, 384, ("fused", True)),
        ("inference", True, 512, ("fused", False)),
        ("forward", True, 4, ("fused", True)),
        ("forward", False, 4, ("eager", False)),
        ("always", True, 4, ("eager", False)),
        ("never", False, 4, ("fused", False)),
    ],
)
def test_compiled_tier_by_setting_gradient_and_rank(monkeypatch, when, needs_grad, rank, want):
    """``functional.compiled_tier``: "auto" gives training graphs the torch forward from
    ``COMPILED_TORCH_FORWARD_MIN_RANK`` (384) on; the other values ignore the rank."""
    from dora_torch import config, functional

    assert config.COMPILED_TORCH_COMPOSE == "auto" and config.COMPILED_TORCH_FORWARD_MIN_RANK == 384
    monkeypatch.setattr(config, "COMPILED_TORCH_COMPOSE", when)
    assert functional.compiled_tier(needs_grad, rank) == want


@pytest.mark.parametrize("bad", [0, -3, 2.0, "256", True, None])
def test_a_bad_torch_forward_min_rank_is_refused_by_name(monkeypatch, bad):
    from dora_torch import config, functional

    monkeypatch.setattr(config, "COMPILED_TORCH_FORWARD_MIN_RANK", bad)
    with pytest.raises(ValueError, match="COMPILED_TORCH_FORWARD_MIN_RANK must be an int"):
        functional.compiled_tier(True, 16)
    assert functional.compiled_tier(False, 16) == ("eager", False)  # inference never reads it
    monkeypatch.setattr(config, "COMPILED_TORCH_FORWARD_MIN_RANK", 8)
    assert functional.compiled_tier(True, 16) == ("fused", True)


def test_compiled_training_composes_with_torch_ops_when_always(monkeypatch):
    """``COMPILED_TORCH_COMPOSE = "always"``: compiled training graphs (here reading the norm
    buffer, ``COMPILED_TRAIN_NORM = "buffer"``) run the forward and backward as torch ops
    too, and follow an uncached fused layer over AdamW steps; with "inference" the training
    graph calls the fused kernels, which the interpreter cannot trace."""
    from dora_torch import config

    monkeypatch.setattr(config, "COMPILED_TRAIN_NORM", "buffer")
    monkeypatch.setattr(config, "COMPILED_TORCH_COMPOSE", "always")
    torch._dynamo.reset()
    layer, x = _fused_layer().train(), torch.randn(5, 24)
    for code in _compiled_steps_match_uncached(layer, x):
        assert "triton" not in code
    monkeypatch.setattr(config, "COMPILED_TORCH_COMPOSE", "inference")
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"[Tt]riton"):
        _compiled_train_graphs(layer, x)


@pytest.mark.parametrize("save", ["recover", "inner", "recompute", "dropout"])
def test_a_torch_forward_before_the_fused_backward_gives_the_fused_results(monkeypatch, save):
    """``COMPILED_TORCH_COMPOSE = "forward"`` runs ``LinearOptions(torch_forward=True)``: the
    eager tier's forward, then the fused backward on what it saved (y to recover inner from,
    inner, or nothing to recompute). Run eagerly here (the interpreter's kernels cannot be
    traced): y and every gradient are the fused tier's, to fp32 rounding, and only the
    backward ran a kernel."""
    from dora_torch import ops

    calls = []

    def counted(kernel):
        def call(*args, **kwargs):
            calls.append(kernel.__name__)
            return kernel(*args, **kwargs)

        return call

    monkeypatch.setattr(ops, "compose_forward", counted(ops.compose_forward))
    monkeypatch.setattr(ops, "scale_reduce", counted(ops.scale_reduce))

    x, W, A, B, m, _, s = random_case_tensors(31, lead=(7,))
    n = dora_torch.factored_norm(W, A, B, s).detach()
    mode = {"recover": ops.SAVE_RECOVER, "recompute": ops.SAVE_RECOMPUTE}.get(save, ops.SAVE_INNER)
    x_d = torch.nn.functional.dropout(x, 0.3, training=True) if save == "dropout" else None
    results = []
    for torch_forward in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (x, A, B, m)]
        xl, Al, Bl, ml = leaves
        xd = None if x_d is None else x_d.clone().requires_grad_(True)
        opts = ops.LinearOptions(s, "fused", mode, torch_forward)
        y = ops.apply_linear(xl, xd, W, Al, Bl, ml, n, None, Al.detach(), Bl.detach(), None, opts)
        grads = torch.autograd.grad(y.square().sum(), leaves + ([xd] if xd is not None else []))
        results.append((y, *grads))
    assert calls == ["compose_forward", "scale_reduce", "scale_reduce"]
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_unknown_compiled_torch_compose_is_refused_by_name(monkeypatch):
    from dora_torch import config

    monkeypatch.setattr(config, "COMPILED_TORCH_COMPOSE", True)
    torch._dynamo.reset()
    layer = _fused_layer().eval()
    with pytest.raises(Exception, match="COMPILED_TORCH_COMPOSE must be one of"), torch.no_grad():
        torch.compile(layer, fullgraph=True, backend="aot_eager")(torch.randn(2, 24))


@pytest.mark.parametrize("buffer", [False, True])
def test_compiled_training_reads_the_base_sq_buffer_only_when_switched_on(monkeypatch, buffer):
    """``config.COMPILED_BASE_SQ_BUFFER``: the compiled training graph takes ‖W‖² from the
    module's buffer instead of reducing W (off: it reduces W, as before), with the same
    output as an uncached eager call, across optimizer steps of every kind of update."""
    from dora_torch import config

    monkeypatch.setattr(config, "COMPILED_BASE_SQ_BUFFER", buffer)
    torch._dynamo.reset()
    layer = _layer().train()  # built with the switch as set: attach fills the buffer
    assert layer.dora_base_sq.numel() == (20 if buffer else 0)
    for code in _compiled_steps_match_uncached(layer, torch.randn(5, 24)):
        assert ("linalg_vector_norm" in code) is not buffer


def test_compiled_training_base_sq_follows_loads_and_steps_and_its_limit(monkeypatch):
    """The buffer follows load_state_dict (post-hook), optimizer steps, clear_caches and mode
    switches. Its documented
    limit (docs/design.md §8, rule 5): an in-place write to the frozen W between steps is
    seen by a compiled training graph only after the next optimizer step (or clear_caches)."""
    from dora_torch import config

    monkeypatch.setattr(config, "COMPILED_BASE_SQ_BUFFER", True)
    torch._dynamo.reset()
    layer, other = _layer(0).train(), _layer(1)
    x = torch.randn(4, 24)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        compiled(x)
        layer.load_state_dict(other.state_dict())
        torch.testing.assert_close(compiled(x), uncached_output(layer, x), rtol=1e-6, atol=1e-6)
        layer.weight.mul_(1.5)
        assert not torch.allclose(compiled(x), uncached_output(layer, x))
    opt = torch.optim.SGD([layer.lora_A], lr=0.0)
    layer.lora_A.grad = torch.zeros_like(layer.lora_A)
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), uncached_output(layer, x), rtol=1e-6, atol=1e-6)
        layer.weight.mul_(0.5)
        dora_torch.clear_caches(layer)
        torch.testing.assert_close(compiled(x), uncached_output(layer, x), rtol=1e-6, atol=1e-6)
        layer.weight.mul_(0.5)
        layer.train()  # a mode switch (here to the mode it had) refreshes it too
        torch.testing.assert_close(compiled(x), uncached_output(layer, x), rtol=1e-6, atol=1e-6)


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(
        params, lr=0.05, fused=kind == "fused", foreach=kind == "foreach" or None
    )


@pytest.mark.parametrize("kind", ["fused", "foreach", "forloop", "sgd"])
def test_compiled_training_reads_a_norm_buffer_fresh_after_every_step(monkeypatch, kind):
    """``config.COMPILED_TRAIN_NORM = "buffer"``: the compiled training graph computes no
    norm (three products fewer than with "graph": U = W Aᵀ, G = A Aᵀ and B·G, and no square
    root), and reads one that every kind of optimizer step has refreshed: its output equals an
    uncached call's."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    from dora_torch import config

    torch._dynamo.reset()
    x = torch.randn(5, 24)
    _, in_graph = _compiled_train_graphs(_layer().train(), x)
    monkeypatch.setattr(config, "COMPILED_TRAIN_NORM", "buffer")
    torch._dynamo.reset()
    layer = _layer().train()
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    opt = _optimizer(kind, [p for p in layer.parameters() if p.requires_grad])
    for _ in range(3):
        opt.zero_grad()
        y = compiled(x)
        torch.testing.assert_close(y, uncached_output(layer, x), rtol=1e-6, atol=1e-6)
        y.square().mean().backward()
        opt.step()
    (graph,) = {g.code for g in backend.fw_graphs}  # traced once, across the steps
    assert graph.count("aten.mm") == in_graph.count("aten.mm") - 3
    assert "aten.sqrt" in in_graph and "aten.sqrt" not in graph


@pytest.mark.parametrize("where", ["graph", "buffer"])
def test_compiled_training_sees_in_place_writes_per_compiled_train_norm(monkeypatch, where):
    """ "graph" computes the norm from A and B at each call, so an in-place write under
    no_grad is seen at once; "buffer" has eval mode's documented limit (docs/design.md §8,
    rule 5): the write is seen after the next optimizer step, eager call or clear_caches."""
    from dora_torch import config

    monkeypatch.setattr(config, "COMPILED_TRAIN_NORM", where)
    torch._dynamo.reset()
    layer = _layer().train()
    x = torch.randn(4, 24)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    close = {"rtol": 1e-6, "atol": 1e-6}
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), uncached_output(layer, x), **close)
        layer.lora_B.mul_(1.5)
        fresh = torch.allclose(compiled(x), uncached_output(layer, x), **close)
        assert fresh is (where == "graph")
        layer(x)  # an eager call recomputes the norm and writes the buffer
        torch.testing.assert_close(compiled(x), uncached_output(layer, x), **close)
        layer.lora_A.mul_(0.5)
    opt = torch.optim.SGD([layer.lora_A], lr=0.0)
    layer.lora_A.grad = torch.zeros_like(layer.lora_A)
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), uncached_output(layer, x), **close)
        layer.lora_B.data.mul_(2.0)  # past every check: clear_caches
        dora_torch.clear_caches(layer)
        torch.testing.assert_close(compiled(x), uncached_output(layer, x), **close)


def test_an_unknown_compiled_train_norm_is_refused_by_name_before_any_change(monkeypatch):
    from dora_torch import config

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    before = [type(m) for m in model.modules()]
    monkeypatch.setattr(config, "COMPILED_TRAIN_NORM", "graphs")
    with pytest.raises(ValueError, match="COMPILED_TRAIN_NORM must be one of"):
        dora_torch.inject(model, target_modules=["0", "1"], r=2, lora_alpha=4)
    assert [type(m) for m in model.modules()] == before
    with pytest.raises(ValueError, match="COMPILED_TRAIN_NORM"):
        dora_torch.Linear(8, 4, r=2, lora_alpha=4)


def test_a_pending_compiled_backward_refuses_a_norm_buffer_refreshed_under_it(monkeypatch):
    """With "buffer", a compiled forward saves the buffer it read; an optimizer step before
    that forward's backward refreshes the buffer in place, and autograd then refuses the
    backward instead of computing gradients with the newer norm."""
    from dora_torch import config

    monkeypatch.setattr(config, "COMPILED_TRAIN_NORM", "buffer")
    torch._dynamo.reset()
    layer = _layer().train()
    y = torch.compile(layer, fullgraph=True, backend="aot_eager")(torch.randn(5, 24))
    layer.lora_B.grad = torch.zeros_like(layer.lora_B)
    torch.optim.SGD([layer.lora_B], lr=0.1).step()  # a step holding B refreshes the buffer
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.square().sum().backward()
