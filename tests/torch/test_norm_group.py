"""``norm_group``: one recomputation of every layer's norm per update, never read stale.

On CPU the group computes its members eagerly (fused tier through the Triton interpreter);
the CUDA-graph capture and replay are tested on the GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dora_torch
from dora_torch import config
from dora_torch.interop.inject import dora_layers, inject

from .helpers import uncached_output

gpu = pytest.mark.gpu


# The fused tier runs on CUDA, or on CPU through the Triton interpreter (CPU CI).
DEVICE = "cpu" if config.interpreting() or not torch.cuda.is_available() else "cuda"


def _model(device=DEVICE, dtype=torch.float32, adapter_dtype=None, seed=0, r=4):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 40), nn.GELU(),
                          nn.Linear(40, 16)).to(device, dtype)  # fmt: skip
    inject(model, target_modules=["0", "2", "4"], r=r, lora_alpha=2 * r,
           adapter_dtype=adapter_dtype)  # fmt: skip
    layers = list(dora_layers(model).values())
    with torch.no_grad():
        for layer in layers:
            layer.impl = "fused"
            layer.lora_B.normal_(0, 0.1)
    return model, layers


def _uncached(layers, x):
    """The model's output with every layer computed by the functional path (no cache)."""
    h = x
    for i, layer in enumerate(layers):
        h = uncached_output(layer, h, impl="fused")
        if i < len(layers) - 1:
            h = nn.functional.gelu(h)
    return h


def _computations(layers):
    return [layer._dora_norm_cache.norm_computations for layer in layers]


def test_inject_groups_every_layer():
    _, layers = _model()
    group = layers[0]._dora_norm_cache.group
    assert group is not None and len(group) == 3
    assert all(layer._dora_norm_cache.group is group for layer in layers)


def test_replay_values_cut_the_static_outputs_into_each_members_entry():
    """What a replay hands each member, from the concatenated outputs as ``_capture`` lays
    them out (the capture itself runs on the GPU): its norm rows, its casts' views, and the
    parameters themselves (detached) where no cast is needed."""
    from dora_torch.cache import compute_state
    from dora_torch.norm_group import replay_values, static_outputs

    torch.manual_seed(0)
    dt = torch.bfloat16
    members, values = [], []
    for d_out, d_in, adapter_dt in ((5, 7, torch.float32), (3, 7, dt), (6, 4, torch.float32)):
        w = torch.randn(d_out, d_in, dtype=dt)
        a = nn.Parameter(torch.randn(2, d_in, dtype=adapter_dt))
        b = nn.Parameter(torch.randn(d_out, 2, dtype=adapter_dt))
        members.append((None, w, a, b, 0.5))
        values.append(compute_state(w, a, b, None, 0.5, "eager", dt))
    norms, flat_casts, layout = static_outputs(members, values, dt)
    assert flat_casts.numel() == sum(t.numel() for (_, _, a, b, _) in members
                                     for t in (a, b) if t.dtype != dt)  # fmt: skip
    got = replay_values(norms.clone(), flat_casts.clone(), layout)
    assert len(got) == len(values)
    for (_, _, a, b, _), want, entry in zip(members, values, got, strict=True):
        for g, w in zip(entry, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w)
        for param, g in ((a, entry[1]), (b, entry[2])):
            assert not g.requires_grad
            # the parameter itself where no cast is needed; a view of the copy otherwise
            assert (g.data_ptr() == param.data_ptr()) == (param.dtype == dt)


@pytest.mark.parametrize("opt_kind", ["adamw_fused", "adamw_foreach", "sgd"])
def test_one_refresh_per_step_and_never_stale(opt_kind):
    model, layers = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = {
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=0.05, fused=True),
        "adamw_foreach": lambda: torch.optim.AdamW(params, lr=0.05, foreach=True),
        "sgd": lambda: torch.optim.SGD(params, lr=0.05),
    }[opt_kind]()
    x = torch.randn(6, 24, device=DEVICE)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        before = _computations(layers)
        with torch.no_grad():
            got = model(x)
        # The first layer's miss refreshed all three members, once each.
        assert _computations(layers) == [c + 1 for c in before]
        assert torch.equal(got, _uncached(layers, x))


def test_a_member_changed_after_the_refresh_is_recomputed():
    model, layers = _model()
    x = torch.randn(5, 24, device=DEVICE)
    with torch.no_grad():
        layers[0](x)  # refreshes all members
        layers[2].lora_B.add_(0.5)  # in place, after the refresh: its entry is now stale
        before = _computations(layers)
        got = model(x)
    assert torch.equal(got, _uncached(layers, x))
    # Layers 0 and 1 hit; layer 2 missed, and a miss refreshes every member (one replay).
    assert _computations(layers) == [c + 1 for c in before]


def test_eval_buffers_of_every_member_follow_a_refresh():
    """Compiled eval graphs read each layer's norm buffer: a refresh that one layer's eager
    call starts must write every eval-mode member's buffer, not only the caller's."""
    model, layers = _model()
    model.eval()
    x = torch.randn(5, 24, device=DEVICE)
    with torch.no_grad():
        for layer in layers:
            layer.lora_B.add_(0.5)  # no optimizer step: only the versions moved
        model(x)  # the first layer's miss refreshes all three
        for layer in layers:
            fresh = dora_torch.factored_norm(
                layer.weight, layer.lora_A, layer.lora_B, layer.scaling, impl="fused"
            )
            torch.testing.assert_close(layer.dora_norm, fresh, rtol=1e-6, atol=0)


def test_calls_the_group_does_not_compute_take_the_layer_path():
    model, layers = _model()
    layers[1].impl = "eager"  # another tier: left out of the group, computed alone
    x = torch.randn(5, 24, device=DEVICE)
    with torch.no_grad():
        got = model(x)
    want = _uncached(layers[:1], x)
    want = nn.functional.gelu(want)
    want = nn.functional.gelu(uncached_output(layers[1], want, impl="eager"))
    want = uncached_output(layers[2], want, impl="fused")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert _computations(layers) == [1, 1, 1]


def test_removed_and_dead_members_leave_the_group():
    _, layers = _model()
    group = layers[0]._dora_norm_cache.group
    group.remove(layers[1])
    assert len(group) == 2 and layers[1]._dora_norm_cache.group is None
    x = torch.randn(3, 24, device=DEVICE)
    with torch.no_grad():
        layers[0](x)
    assert _computations(layers) == [1, 0, 1]
    extra = dora_torch.Linear.from_linear(
        nn.Linear(24, 8, device=DEVICE), r=2, lora_alpha=4, impl="fused"
    )
    group.add(extra)
    assert len(group) == 3
    del extra
    assert len(group) == 2


def _count_lookups(monkeypatch, layers) -> list[int]:
    """A counter of the group's adapter lookups (``_dora_tensors``, one per member in a full
    look at the members)."""
    calls = [0]
    for layer in layers:
        real = layer._dora_tensors

        def counted(module, real=real):
            calls[0] += 1
            return real(module)

        monkeypatch.setattr(layer, "_dora_tensors", counted)
    return calls


def test_refreshes_reuse_the_last_member_list_until_it_changes(monkeypatch):
    """After one refresh, the next ones take the members from the last one's list without a
    lookup per member; a request whose tensors are not the listed ones (a replaced
    adapter) looks at every member again, and computes that member from its new tensors."""
    model, layers = _model()
    lookups = _count_lookups(monkeypatch, layers)
    x = torch.randn(5, 24, device=DEVICE)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        with torch.no_grad():
            got = model(x)
        assert torch.equal(got, _uncached(layers, x))

    step()
    assert lookups[0] == 3  # the first refresh looked at every member
    step()
    step()
    assert lookups[0] == 3  # later refreshes reused the list
    with torch.no_grad():
        new_b = nn.Parameter(layers[1].lora_B.detach() + 0.25)
    layers[1].lora_B = new_b  # a new object: the listed one is not this layer's any more
    opt.add_param_group({"params": [new_b]})
    before = _computations(layers)
    step()
    # Layer 1 missed its entry (computed from the old B): its request no longer matched the
    # list, so the group looked at every member and refreshed all three from the new tensors.
    assert lookups[0] == 6
    assert _computations(layers) == [c + 2 for c in before]
    step()
    assert lookups[0] == 6


def test_the_list_is_dropped_when_a_member_changes_what_a_refresh_writes():
    _, layers = _model()
    group = layers[0]._dora_norm_cache.group
    x = torch.randn(3, 24, device=DEVICE)
    with torch.no_grad():
        layers[0](x)
    w = layers[0].weight
    assert group._relisted(w) is not None
    layers[2].weight.data = layers[2].weight.data.double()
    assert group._relisted(w) is None  # would be computed in another dtype: look again
    layers[2].weight.data = layers[2].weight.data.float()
    assert group._relisted(w) is not None
    old_w = layers[2].weight  # kept alive here, as a user's reference would
    layers[2].weight = nn.Parameter(old_w.detach() + 1.0, requires_grad=False)
    assert group._relisted(w) is None  # ‖W‖² of the listed W is not this layer's any more
    layers[2].weight = old_w
    assert group._relisted(w) is not None
    # In eval mode a refresh writes the norm buffer, which must come from the layer's
    # current tensors (the flag alone: eval() itself refreshes through the cache).
    layers[1].training = False
    assert group._relisted(w) is None
    layers[1].training = True
    assert group._relisted(w) is not None
    del layers[2].lora_A  # its A is gone
    import gc

    gc.collect()
    assert group._relisted(w) is None


@pytest.mark.parametrize("replaced", ["weight", "lora_B"])
def test_buffers_a_refresh_writes_follow_the_members_current_tensors(replaced):
    """What a refresh writes besides the entries, compiled graphs read without checks: the
    ‖W‖² buffer (training) and, in eval mode, the norm buffer. A member whose W or B was
    replaced by a new Parameter (the old one still alive) gets them from its new tensors when
    another layer's miss starts the refresh."""
    model, layers = _model()
    if replaced == "lora_B":
        model.eval()
    x = torch.randn(5, 24, device=DEVICE)
    with torch.no_grad():
        model(x)  # refreshes all three and lists them
        old = getattr(layers[1], replaced)
        new = nn.Parameter(old.detach() + 0.5, requires_grad=old.requires_grad)
        setattr(layers[1], replaced, new)
        layers[0].lora_B.add_(0.25)  # layer 0's next call misses: a refresh of the group
        layers[0](x)
    if replaced == "weight":
        torch.testing.assert_close(
            layers[1].dora_base_sq, new.detach().float().square().sum(1), rtol=1e-6, atol=0
        )
    else:
        fresh = dora_torch.factored_norm(
            layers[1].weight, layers[1].lora_A, new, layers[1].scaling, impl="fused"
        )
        torch.testing.assert_close(layers[1].dora_norm, fresh, rtol=1e-6, atol=0)
    assert old is not None  # alive until here


def test_a_request_the_group_cannot_serve_drops_the_list():
    model, layers = _model()
    group = layers[0]._dora_norm_cache.group
    x = torch.randn(5, 24, device=DEVICE)
    with torch.no_grad():
        model(x)
        assert group._listed is not None
        layers[1].impl = "eager"  # listed as fused; its next call is the eager tier's
        layers[1].lora_B.add_(0.5)
        model(x)
        assert group._listed is None
        layers[2].lora_B.add_(0.5)
        model(x)  # layer 2's miss: a full look, which leaves the eager layer out
    assert [entry[1] for entry in group._listed] == [
        layers[0]._dora_norm_cache,
        layers[2]._dora_norm_cache,
    ]


def test_accelerate_peft_groups_its_layers():
    pytest.importorskip("peft")
    from tests.parity.models import ALL_PROJ, peft_dora, tiny_llama

    pm = peft_dora(tiny_llama(), target_modules=ALL_PROJ)
    dora_torch.accelerate_peft(pm)
    caches = [m._dora_norm_cache for m in pm.modules() if hasattr(m, "_dora_norm_cache")]
    assert len(caches) == 14
    assert len({id(c.group) for c in caches}) == 1 and caches[0].group is not None


# ------------------------------------------------------------------------------------ GPU
def _train(model, x, steps, opt_kind="fused"):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.01, fused=opt_kind == "fused")
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in params]


@gpu
# the gemm's cuBLAS call captured; "pairs" at r = 40 with 16-column blocks: its tickets and
# partials are allocated and zeroed inside the captured graph
@pytest.mark.parametrize(("assembly", "r"), [("kernel", 4), ("gemm", 4), ("pairs", 40)])
@pytest.mark.parametrize("adapter_dtype", [None, torch.bfloat16])
# two streams: the three members become two branches of the graph (NORM_GROUP_STREAMS)
@pytest.mark.parametrize("streams", [1, 2])
def test_graph_replay_matches_layer_by_layer_on_gpu(
    monkeypatch, adapter_dtype, assembly, r, streams
):
    monkeypatch.setattr(config, "NORM_GROUP_STREAMS", streams)
    monkeypatch.setattr(config, "NORM_ASSEMBLY", assembly)
    monkeypatch.setattr(config, "NORM_PAIRS", (16, 16, 4, 2))  # 3 column blocks at r = 40
    x = torch.randn(512, 24, device="cuda", dtype=torch.bfloat16)
    ref_model, _ = _model("cuda", torch.bfloat16, adapter_dtype, r=r)
    monkeypatch.setattr(config, "NORM_GROUP_GRAPHS", False)
    want_losses, want_params = _train(ref_model, x, 5)
    monkeypatch.setattr(config, "NORM_GROUP_GRAPHS", True)
    model, layers = _model("cuda", torch.bfloat16, adapter_dtype, r=r)
    losses, params = _train(model, x, 5)
    group = layers[0]._dora_norm_cache.group
    assert group.captures == 1 and group.replays >= 3
    assert len(group._streams) == streams - 1
    torch.testing.assert_close(losses, want_losses, rtol=0, atol=0)
    for p, q in zip(params, want_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    with torch.no_grad():
        assert torch.equal(model(x), _uncached(layers, x))


@gpu
def test_a_replay_never_changes_a_pending_backward_on_gpu():
    """forward → optimizer step elsewhere → forward (a replay) → the first backward still
    sees the norm of its own forward."""
    x = torch.randn(512, 24, device="cuda", dtype=torch.bfloat16)
    model, layers = _model("cuda", torch.bfloat16, torch.float32)
    _train(model, x, 3)  # captured by now
    group = layers[0]._dora_norm_cache.group
    assert group.captures == 1
    with torch.no_grad():
        want_n = [layer._dora_norm_cache.state(layer.weight, layer.lora_A, layer.lora_B,
                  layer.scaling, impl="fused", dtype=torch.bfloat16)[0].clone()
                  for layer in layers]  # fmt: skip
    y1 = model(x)
    saved = [layer._dora_norm_cache._state[1][0] for layer in layers]
    with torch.no_grad():
        for layer in layers:
            layer.lora_B.add_(0.25)
    other = torch.optim.SGD([torch.zeros(1, device="cuda", requires_grad=True)], lr=0.1)
    other.step()  # any optimizer step moves every key
    model(x)  # a replay
    assert group.replays >= 4
    for n, w in zip(saved, want_n, strict=True):
        assert torch.equal(n, w)
    y1.float().sum().backward()  # uses the saved norms: no error, no silent change


def test_prepare_fsdp_takes_layers_out_of_their_group():
    """Under FSDP2 a layer's W exists only inside its own all-gather window, so prepared
    layers compute their norms alone."""
    pytest.importorskip("torch.distributed.fsdp")
    from dora_torch.distributed import prepare_fsdp

    model, layers = _model()
    group = layers[0]._dora_norm_cache.group
    assert prepare_fsdp(model) == 3
    assert len(group) == 0
    assert all(layer._dora_norm_cache.group is None for layer in layers)
    x = torch.randn(4, 24, device=DEVICE)
    with torch.no_grad():
        got = model(x)
    assert torch.equal(got, _uncached(layers, x))


def test_group_follows_merges_loads_and_accumulation():
    model, layers = _model()
    x = torch.randn(4, 24, device=DEVICE)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.05, fused=True)
    # gradient accumulation: two micro-batches, one refresh
    before = _computations(layers)
    for _ in range(2):
        model(x).square().mean().backward()
    assert _computations(layers) == [c + 1 for c in before]
    opt.step()
    opt.zero_grad()
    # a merged member leaves the group's work; the others stay exact
    layers[1].merge()
    with torch.no_grad():
        got = model(x)
        want = uncached_output(layers[0], x, impl="fused")
        merged = layers[1]  # computes with its merged weight: a plain linear layer
        want = nn.functional.linear(nn.functional.gelu(want), merged.weight, merged.bias)
        want = uncached_output(layers[2], nn.functional.gelu(want), impl="fused")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    layers[1].unmerge()
    # load_state_dict writes every parameter in place
    state = {k: v.clone() + 0.01 for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(model(x), _uncached(layers, x))


def test_scalora_merges_keep_the_group_exact():
    """ScaLoRA writes W in place and updates ‖W‖² in factored form: the cached ‖W‖² keeps
    its address (what a captured group reads) and every output stays exact."""
    model, layers = _model()
    base_sq = [layer._dora_norm_cache.base_sq(layer.weight) for layer in layers]
    x = torch.randn(6, 24, device=DEVICE)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.01)
    dora_torch.ScaLoRA(model, opt).register()
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        with torch.no_grad():
            torch.testing.assert_close(model(x), _uncached(layers, x), rtol=1e-5, atol=1e-6)
    for layer, q in zip(layers, base_sq, strict=True):
        assert layer._dora_norm_cache.base_sq(layer.weight) is q


@gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_step_hook_refreshes_eval_buffers_with_one_replay_on_gpu(mode):
    """A model in eval mode whose adapters an optimizer updates (inference between updates):
    after each step the global hook recomputes the whole group with one replay and one
    foreach copy into the norm buffers, before any forward asks; compiled eval graphs
    (Inductor, and CUDA graphs) read fresh norms."""
    torch._dynamo.reset()
    x = torch.randn(512, 24, device="cuda", dtype=torch.bfloat16)
    model, layers = _model("cuda", torch.bfloat16, torch.float32)
    model.eval()  # dropout is 0: the eager steps below are training steps in eval mode
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    group = layers[0]._dora_norm_cache.group
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)  # no version bumps
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        replays = group.replays
        opt.step()
        assert group.replays == replays + 1  # the hook's, with no forward since the step
        for layer in layers:  # an independent norm, not the cache's
            n = dora_torch.factored_norm(layer.weight, layer.lora_A, layer.lora_B, layer.scaling)
            torch.testing.assert_close(layer.dora_norm, n.detach(), rtol=1e-5, atol=0)
        with torch.no_grad():
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(x).clone()
            torch.testing.assert_close(got, _uncached(layers, x), rtol=2e-2, atol=2e-2)
