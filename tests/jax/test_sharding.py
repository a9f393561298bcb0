"""DoRA on a device mesh (docs/design.md §11, ``dora_jax.sharding``).

Two kinds of tests:

* In this process (one CPU device, 1×1 meshes): the adapter specs that follow the kernel,
  nnx metadata (eager, lazy, logical names), ``annotate``.
* On 4 forced host CPU devices (a 2×2 data × model mesh) in a subprocess: the forced device
  count must be set before jax starts its backend, which the other test modules have already
  done here. The subprocess runs this file as ``python -m tests.jax.test_sharding OUT``
  (``_worker``), writes every (sharded, unsharded) pair of arrays to OUT/arrays.npz and facts
  (specs, collectives) to OUT/facts.json; the tests below compare them.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dora_jax import DoraDense, base_sq_norm, factored_norm, inject
from dora_jax.models.llama import LlamaConfig, LlamaForCausalLM
from dora_jax.sharding import (
    LLAMA_TP_RULES,
    NormSharding,
    adapter_specs,
    annotate,
    kernel_spec_of,
    layer_norm,
    sharded_factored_norm,
    sharded_norm_parts,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
COL, ROW = (None, "model"), ("model", None)
RTOL = 1e-5  # fp32: max |sharded − unsharded| ≤ RTOL · max |unsharded| (sum order only)
PARAMS = ("kernel", "lora_a", "lora_b", "magnitude")
SPECS = {  # where a DoraDense's parameters lie (trailing Nones dropped, as _spec)
    "col": {
        "kernel": [None, "model"],
        "lora_a": [],
        "lora_b": [None, "model"],
        "magnitude": ["model"],
    },
    "row": {"kernel": ["model"], "lora_a": ["model"], "lora_b": [], "magnitude": []},
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _mesh11():
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((1, 1), ("data", "model"), axis_types=(auto, auto))


def _partitioned_linear(spec, d_in=16, d_out=24, **kw):
    init = nnx.initializers.lecun_normal()
    if spec is not None:
        init = nnx.with_partitioning(init, spec, **kw)
    return nnx.Linear(d_in, d_out, rngs=nnx.Rngs(0), kernel_init=init)


def _spec(array) -> list:
    """An array's PartitionSpec as a JSON-able list, trailing Nones dropped (P(None) == P())."""
    spec = [list(e) if isinstance(e, tuple) else e for e in array.sharding.spec]
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def _tiny_llama_config():
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )


# --------------------------------------------------------------------------------------------
# in this process
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kernel", "a", "b", "m"),
    [
        (COL, P(None, None), P(None, "model"), P("model")),
        (ROW, P("model", None), P(None, None), P(None)),
        (("data", "model"), P("data", None), P(None, "model"), P("model")),
        ((("data", "model"), None), P(("data", "model"), None), P(None, None), P(None)),
        ((None, None), P(None, None), P(None, None), P(None)),
    ],
)
def test_adapter_specs(kernel, a, b, m):
    assert adapter_specs(kernel) == (a, b, m)
    assert adapter_specs(P(*kernel)) == (a, b, m)


def test_adapter_specs_rejects_bad_specs():
    with pytest.raises(ValueError, match="two entries"):
        adapter_specs(("model",))
    with pytest.raises(ValueError, match="both d_in and d_out"):
        adapter_specs(("model", "model"))
    with pytest.raises(ValueError, match="entry"):
        adapter_specs((3, None))
    with pytest.raises(ValueError, match="both d_in and d_out"):
        NormSharding((("data", "model"), "model"))


@pytest.mark.parametrize("kernel", [COL, ROW])
def test_metadata_follows_the_kernel(kernel):
    """DoraDense (``_adapter_sharding``) gives lora_a/lora_b/magnitude the specs of
    ``adapter_specs``: eagerly placed under a mesh, as metadata only without one."""
    a, b, m = adapter_specs(kernel)
    with jax.set_mesh(_mesh11()):
        eager = DoraDense.from_linear(
            _partitioned_linear(kernel), r=4, lora_alpha=8, rngs=nnx.Rngs(1)
        )
    with nnx.use_eager_sharding(False):
        lazy = DoraDense.from_linear(
            _partitioned_linear(kernel), r=4, lora_alpha=8, rngs=nnx.Rngs(1)
        )
    for layer in (eager, lazy):
        specs = nnx.get_partition_spec(nnx.state(layer))
        assert specs["kernel"].get_value() == P(*kernel)
        assert kernel_spec_of(layer) == P(*kernel)
        assert specs["lora_a"].get_value() == a
        assert specs["lora_b"].get_value() == b
        assert specs["magnitude"].get_value() == m
    for name, spec in (("lora_a", a), ("lora_b", b), ("magnitude", m)):
        assert getattr(eager, name).get_value().sharding.spec == spec
    assert kernel_spec_of(DoraDense(4, 4, r=2, lora_alpha=2, rngs=nnx.Rngs(0))) == P(None, None)


def test_metadata_with_logical_rules():
    rules = (("embed", None), ("mlp", "model"))
    with jax.set_mesh(_mesh11()):
        linear = _partitioned_linear(("embed", "mlp"), sharding_rules=rules)
        layer = DoraDense.from_linear(linear, r=4, lora_alpha=8, rngs=nnx.Rngs(1))
    specs = nnx.get_partition_spec(nnx.state(layer))
    assert specs["lora_b"].get_value() == P(None, "model")
    assert specs["magnitude"].get_value() == P("model")


def test_annotate_before_and_after_inject():
    cfg = _tiny_llama_config()
    first = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))  # annotate, then inject: inherited
    names = annotate(first, LLAMA_TP_RULES)
    assert len(names) == 7 and "model.layers.0.mlp.down_proj" in names
    inject(first, target_modules=TARGETS, r=4, lora_alpha=8, rngs=nnx.Rngs(1))
    second = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))  # inject, then annotate
    inject(second, target_modules=TARGETS, r=4, lora_alpha=8, rngs=nnx.Rngs(1))
    assert annotate(second, LLAMA_TP_RULES) == names
    for model in (first, second):
        specs = nnx.get_partition_spec(nnx.state(model))
        attn = specs["model"]["layers"][0]["self_attn"]
        mlp = specs["model"]["layers"][0]["mlp"]
        assert attn["q_proj"]["kernel"].get_value() == P(None, "model")
        assert attn["q_proj"]["lora_a"].get_value() == P(None, None)
        assert attn["q_proj"]["lora_b"].get_value() == P(None, "model")
        assert attn["q_proj"]["magnitude"].get_value() == P("model")
        assert mlp["down_proj"]["kernel"].get_value() == P("model", None)
        assert mlp["down_proj"]["lora_a"].get_value() == P("model", None)
        assert mlp["down_proj"]["lora_b"].get_value() == P(None, None)
        assert mlp["down_proj"]["magnitude"].get_value() == P(None)
        assert specs["lm_head"]["kernel"].get_value() == P()  # untouched: replicated


# --------------------------------------------------------------------------------------------
# on a 2×2 mesh of forced CPU devices, in a subprocess
# --------------------------------------------------------------------------------------------


def _worker(out: pathlib.Path) -> None:
    """Every multi-device check, run once; see the module docstring."""
    from jax.sharding import NamedSharding

    from dora_jax.sharding import named, place

    assert len(jax.devices()) >= 4, jax.devices()
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(auto, auto))
    arrays, facts = {}, {}

    def record(name, got, want):
        arrays[f"{name}|got"], arrays[f"{name}|want"] = np.asarray(got), np.asarray(want)

    def collectives(compiled) -> dict[str, int]:
        hlo = compiled.as_text()
        ops = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
        return {op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(") for op in ops}

    lora = nnx.DiffState(0, nnx.LoRAParam)

    def sin_loss(model, x):
        y = model(x)
        return jnp.sum(jnp.sin(y)), y

    @nnx.jit
    def dense_step(model, x):
        (_, y), grads = nnx.value_and_grad(sin_loss, argnums=lora, has_aux=True)(model, x)
        return y, grads

    # 1. DoraDense: x [4, 4, 32] on "data", kernel column- or row-parallel, both impls.
    def dense(kernel, impl, exact, shard_norm=False):
        layer = DoraDense.from_linear(
            _partitioned_linear(kernel, 32, 48), r=4, lora_alpha=8, rngs=nnx.Rngs(1), impl=impl,
            exact_norm_grad=exact, shard_norm=shard_norm,
        )  # fmt: skip
        # set_value keeps no placement: put the new values where the old ones lie
        b, m = layer.lora_b.get_value(), layer.magnitude.get_value()
        new_b = 0.1 * jax.random.normal(jax.random.key(2), b.shape)
        layer.lora_b.set_value(jax.device_put(new_b, b.sharding))
        layer.magnitude.set_value(jax.device_put(1.3 * m, m.sharding))
        return layer

    x = jax.random.normal(jax.random.key(3), (4, 4, 32))
    x_sharded = jax.device_put(x, named(mesh, "data", None, None))
    cases = [
        ("xla", False, (COL, ROW), False),
        ("xla", True, (COL, ROW), False),
        # shard_norm: the norm as a shard_map
        ("xla", False, (COL, ROW), True),
        ("xla", True, (COL, ROW), True),
    ]
    for impl, exact, kernels, shard_norm in cases:
        y0, g0 = dense_step(dense(None, impl, exact), x)
        tag = f"{impl}{'-exact' if exact else ''}{'-shard-norm' if shard_norm else ''}"
        for kernel in kernels:
            name = f"dense/{tag}/{'col' if kernel == COL else 'row'}"
            with jax.set_mesh(mesh):
                layer = dense(kernel, impl, exact, shard_norm)
                y1, g1 = dense_step(layer, x_sharded)
            record(f"{name}/y", y1, y0)
            for p in ("lora_a", "lora_b", "magnitude"):
                record(f"{name}/d{p}", g1[p].get_value(), g0[p].get_value())
            facts[name] = {p: _spec(getattr(layer, p).get_value()) for p in PARAMS}

    # 2. The sharded-init recipe (layers built inside nnx.jit, then constrained) keeps the specs.
    @nnx.jit
    def create():
        layer = DoraDense.from_linear(_partitioned_linear(ROW), r=4, lora_alpha=8, rngs=nnx.Rngs(1))
        state = nnx.state(layer)
        nnx.update(layer, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return layer

    with jax.set_mesh(mesh):
        made = create()
    facts["jit_init"] = {p: _spec(getattr(made, p).get_value()) for p in PARAMS}

    # 3. The inject-ed Llama twin, Megatron split (annotate + place), batch on "data".
    cfg = _tiny_llama_config()

    def llama():
        model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
        # column- and row-parallel, in attention and in the MLP (all 7: the example)
        targets = ["q_proj", "o_proj", "up_proj", "down_proj"]
        inject(model, target_modules=targets, r=4, lora_alpha=8, rngs=nnx.Rngs(1))
        for path, v in nnx.state(model, nnx.LoRAParam).flat_state():  # a trained-looking b
            if path[-1] == "lora_b":
                v.set_value(0.05 * jax.random.normal(jax.random.key(7), v.get_value().shape))
        return model

    def lm_loss(model, ids):
        logits = model(ids[:, :-1])
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)
        return -jnp.mean(logp), logits

    @nnx.jit
    def lm_step(model, ids):
        (loss, logits), grads = nnx.value_and_grad(lm_loss, argnums=lora, has_aux=True)(model, ids)
        return logits, loss, grads

    ids = jax.random.randint(jax.random.key(4), (4, 12), 0, cfg.vocab_size)
    logits0, loss0, g0 = lm_step(llama(), ids)
    model = llama()
    annotate(model, LLAMA_TP_RULES)
    place(model, mesh)
    with jax.set_mesh(mesh):
        logits1, loss1, g1 = lm_step(model, jax.device_put(ids, named(mesh, "data", None)))
    record("llama/logits", logits1, logits0)
    record("llama/loss", loss1, loss0)
    flat0 = dict(g0.flat_state())
    for path, v in g1.flat_state():
        record("llama/d" + ".".join(map(str, path)), v.get_value(), flat0[path].get_value())
    layer0 = model.model.layers[0]
    facts["llama"] = {
        "q_proj": {p: _spec(getattr(layer0.self_attn.q_proj, p).get_value()) for p in PARAMS},
        "down_proj": {p: _spec(getattr(layer0.mlp.down_proj, p).get_value()) for p in PARAMS},
    }

    # 4. The factored norm under shard_map vs factored_norm, and its collectives.
    k = jax.random.normal(jax.random.key(5), (64, 48))
    a = 0.1 * jax.random.normal(jax.random.key(6), (64, 4))
    b = 0.1 * jax.random.normal(jax.random.key(7), (4, 48))
    want = factored_norm(k, a, b, 2.0)
    want_w = 2.0 * (a.T @ k) + 4.0 * (a.T @ a) @ b  # s·U + s²·G·b
    specs = {"col": COL, "row": ROW, "2d": ("data", "model")}
    for label, spec in specs.items():
        sa, sb, sn = adapter_specs(spec)
        args = (
            jax.device_put(k, NamedSharding(mesh, P(*spec))),
            jax.device_put(a, NamedSharding(mesh, sa)),
            jax.device_put(b, NamedSharding(mesh, sb)),
        )
        f = jax.jit(
            lambda k, a, b, spec=spec: sharded_factored_norm(
                k, a, b, 2.0, kernel_spec=spec, mesh=mesh, impl="xla"
            )
        )
        compiled = f.lower(*args).compile()
        n = compiled(*args)
        record(f"norm/{label}/xla", n, want)
        facts[f"norm/{label}/xla"] = {"spec": _spec(n), **collectives(compiled)}
        # norm_parts' form: the mesh from the context, a given base_sq (not psum-ed), and w
        parts = functools.partial(
            sharded_norm_parts,
            sharding=NormSharding(spec),
            scaling=2.0,
            grad_parts=True,
        )
        with jax.set_mesh(mesh):
            sq = jax.device_put(base_sq_norm(k), NamedSharding(mesh, sn))
            n, w = jax.jit(parts)(*args, sq)
        record(f"norm/{label}/parts-n", n, want)
        record(f"norm/{label}/parts-w", w, want_w)

    # 5. Inference with a frozen norm computed by the shard_map.
    from dora_jax import DoraCache

    with jax.set_mesh(mesh):
        layer = dense(ROW, "xla", False)
        call = nnx.jit(lambda m, x: m(x))
        y_live = call(layer, x_sharded)
        layer.frozen_norm = DoraCache(layer_norm(layer, mesh))
        y_frozen = call(layer, x_sharded)
        record("frozen/norm", layer.frozen_norm.get_value(), layer.norm())
    record("frozen/y", y_frozen, y_live)

    # 6. The example, 3 steps, with its unsharded check.
    from examples.jax_sharded_train import main

    facts["example"] = main(
        ["--steps", "3", "--batch-size", "4", "--seq-len", "16", "--layers", "1"]
    )

    np.savez(out / "arrays.npz", **arrays)
    (out / "facts.json").write_text(json.dumps(facts))


@pytest.fixture(scope="module", autouse=True)
def _worker_process(request, tmp_path_factory):
    """Starts the worker when this module's first test starts (if any selected test needs it),
    so it runs while the in-process tests do."""
    mine = [item for item in request.session.items if item.path == request.path]
    if not any("multi" in item.fixturenames for item in mine):
        yield None
        return
    out = tmp_path_factory.mktemp("sharding")
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=4"])
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.jax.test_sharding", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def multi(_worker_process):
    proc, out = _worker_process
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"worker failed:\n{stdout[-4000:]}\n{stderr[-8000:]}"
    with np.load(out / "arrays.npz") as data:
        arrays = dict(data)
    return arrays, json.loads((out / "facts.json").read_text())


def _compare(arrays, prefix, rtol=RTOL):
    names = sorted({k.split("|")[0] for k in arrays if k.startswith(prefix)})
    assert names, prefix
    for name in names:
        got, want = arrays[f"{name}|got"], arrays[f"{name}|want"]
        assert got.shape == want.shape, name
        scale = float(np.max(np.abs(want)))
        assert scale > 0, f"{name}: reference is all zeros (a vacuous check)"
        err = float(np.max(np.abs(got - want)))
        assert err <= rtol * scale, f"{name}: max |Δ| {err:.3g} > {rtol} · {scale:.3g}"
    return names


@pytest.mark.parametrize("case", ["xla", "xla-exact", "xla-shard-norm", "xla-exact-shard-norm"])
def test_dense_matches_unsharded(multi, case):
    """Forward and the three adapter gradients under a 2×2 mesh (x on "data", the kernel
    column- or row-parallel) equal the unsharded layer's, the norm's gradient included
    (exact_norm_grad). XLA partitions the XLA path; with shard_norm the norm is a shard_map."""
    arrays, facts = multi
    splits = ("col", "row")
    names = _compare(arrays, f"dense/{case}/")  # "/" ends the tag: no prefix collisions
    assert len(names) == 4 * len(splits)  # (y, da, db, dm) per split
    for split in splits:
        assert facts[f"dense/{case}/{split}"] == SPECS[split]


def test_jit_init_recipe_keeps_adapter_specs(multi):
    """Layers built inside nnx.jit (tracers: metadata only) and then constrained by
    nnx.get_partition_spec land where the kernel's spec says."""
    _, facts = multi
    assert facts["jit_init"] == SPECS["row"]


def test_injected_llama_matches_unsharded(multi):
    arrays, facts = multi
    names = _compare(arrays, "llama/")
    assert len(names) == 2 + 4 * 3  # logits, loss, (a, b, m) of the 4 adapted projections
    assert facts["llama"] == {"q_proj": SPECS["col"], "down_proj": SPECS["row"]}


def test_shard_map_norm_matches_and_communicates_only_for_sharded_d_in(multi):
    """d_out sharded: no collective and n stays sharded. d_in sharded: one all-reduce (the
    psum of ‖K‖², U and G) and no all-gather."""
    arrays, facts = multi
    assert len(_compare(arrays, "norm/")) == 3 * 3  # (xla, parts n and w) × 3 splits
    col = facts["norm/col/xla"]
    assert col["spec"] == ["model"]
    assert sum(v for k, v in col.items() if k != "spec") == 0, col
    for label in ("row", "2d"):
        f = facts[f"norm/{label}/xla"]
        assert f["all-reduce"] == 1 and f["all-gather"] == 0, (label, f)
    assert facts["norm/row/xla"]["spec"] == []
    assert facts["norm/2d/xla"]["spec"] == ["model"]


def test_frozen_norm_from_shard_map(multi):
    arrays, _ = multi
    _compare(arrays, "frozen/")


def test_example_trains(multi):
    _, facts = multi
    ex = facts["example"]
    assert len(ex["losses"]) == 3 and all(np.isfinite(ex["losses"]))
    assert ex["losses"][-1] < ex["losses"][0]
    # the adapters stay where the kernels put them through the optimizer updates
    assert ex["specs"]["self_attn/q_proj/lora_b"] == "P(None, 'model')"
    assert ex["specs"]["mlp/down_proj/lora_a"] == "P('model', None)"
    assert ex["specs"]["mlp/down_proj/magnitude"] == "P(None,)"


if __name__ == "__main__":
    _worker(pathlib.Path(sys.argv[1]))
