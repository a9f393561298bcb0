"""The eager step's host (Python + dispatch) time per layer, measured on the CPU.

Issue 10's eager batch-1 step is host-bound on slow hosts (benchmarks/NOTES.md, runs 69-71,
82): the gap to PEFT LoRA there is the Python that runs around each layer's launches. That
Python is the same on any machine, so it can be measured without a GPU: a small
transformers Llama on the CPU (every projection adapted), tiny shapes so that the arithmetic
is negligible, and the fused tier's host path run as it runs on CUDA, with each Triton
launch replaced by a call that does nothing:

  - the tier resolves to "fused" (``dispatch.resolve_impl``);
  - each ``Launcher`` runs its whole Python (arguments, specialisation key, cache lookup)
    and ends in a no-op instead of Triton's C launcher;
  - the launchability check accepts CPU tensors (the kernels would never read them), and
    the one-pass norm applies where it would on CUDA.

The kernels' outputs are left as allocated (only the host time is read). The group's
CUDA-graph replay of the norms needs a GPU, so ``--workload model`` (default) times a
forward and backward with the norms cached (adapters unchanged), not the optimizer step.
``--workload train_step`` times what users run: ``zero_grad``, forward, backward and an
``AdamW(foreach=True)`` step (its hook included), each in its own column. Its forward pays
the norm group's refresh after each step on the path it takes on a GPU: the members listed,
their graph signature checked, one replay (of a stand-in graph that does nothing: the
capture ran the members once, launches as no-ops), the entries installed. A revision whose
``norm_group`` has no ``graphs_possible`` (before session 36) computes its members one by
one instead, so its forward is not comparable there (the harness says so).
``--workload step_hook`` times the optimizer-step hook alone (``cache._count_step``: every
cached module's ‖W‖² and norm buffers checked after each step; variants ``ours``,
``ours_rev``). ``--workload guards`` times Dynamo's guard check of ``torch.compile(model)``'s
forward alone, what a compiled call evaluates before its graph's first kernel (each model
compiled once in train mode, backend "eager", its layers on their CPU tier; variants
``peft_lora``, ``ours``, ``ours_rev``). ``--workload layer`` times issue 10's one-layer row instead
(``bench_torch_layer``'s eager fwd+bwd: one ``dora_torch.Linear``, its norm recomputed in
every call, against the cuBLAS LoRA-equivalent ``lora_eq``; variants ``lora_eq``, ``ours``,
``ours_stacked``, ``ours_rev``).
Variants take turns in rounds, every other round in reverse order (``--rounds``,
``--per-round``); printed: medians of the forward and the backward, and each variant's
excess over the first (PEFT LoRA; ``lora_eq`` in the layer workload) per layer call, in µs.
On a host-bound H200 machine the same calls took 4-7× this container's CPU time (NOTES,
session 32, from run 69). ``--rev DIR`` adds ``ours_rev``, a ``revision_copy`` of an earlier
commit, to the same rounds: an A/B in one process. An A/A (a copy of HEAD) read ``ours_rev``
1.5-5.6 µs per call faster than the same code as ``ours`` in the layer workload, 0.4 in the
model workload: changes of a few µs need that A/A beside them. ``--profile VARIANT`` prints a
cProfile of one variant instead (cProfile inflates Python calls several-fold: read the
rounds for sizes, the profile for names).

    python3 -m benchmarks.host_step_cpu
    python3 -m benchmarks.revision_copy HEAD --dest .rev
    python3 -m benchmarks.host_step_cpu --variants peft_lora ours --rev .rev
    python3 -m benchmarks.host_step_cpu --profile ours --per-round 20
    python3 -m benchmarks.host_step_cpu --workload layer --rev .rev
    python3 -m benchmarks.host_step_cpu --workload train_step --rev .rev
    python3 -m benchmarks.host_step_cpu --workload guards
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import importlib
import inspect
import pathlib
import pstats
import statistics
import time
import types
from unittest import mock

import torch

VARIANTS = ("peft_lora", "ours", "peft_dora", "lora_eq", "ours_stacked")
WORKLOADS = ("model", "layer")
ADAPTED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _NoopCompiled:
    """What ``kernel[grid](...)`` returns to a ``Launcher``: its fast path then calls ``run``."""

    function = 0
    packed_metadata = None

    @staticmethod
    def run(*args):
        return None


class _StandInGraph:
    """``torch.cuda.CUDAGraph`` on the CPU: its capture runs the body once (eagerly, as
    ``_stand_in_capture`` lets it), a replay does nothing."""

    def replay(self) -> None:
        return None


@contextlib.contextmanager
def _stand_in_capture(graph, *args, **kwargs):
    """``torch.cuda.graph(graph)``: the body runs as it is."""
    yield


class _NoopKernel:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **options)``."""

    __name__ = "noop"

    def __getitem__(self, grid):
        return lambda *args, **options: _NoopCompiled()


@contextlib.contextmanager
def fused_host_path(packages=("dora_torch",)):
    """Run each package's (dora_torch, or a ``revision_copy`` of it) fused tier on CPU
    tensors with every Triton launch a no-op. Yields the packages' ``Launcher``s."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "CUDAGraph", _StandInGraph))
        stack.enter_context(mock.patch.object(torch.cuda, "graph", _stand_in_capture))
        launchers = []
        for package in packages:
            launchers += stack.enter_context(_fused_host_path(package))
        yield launchers


@contextlib.contextmanager
def _fused_host_path(package: str):
    functional = importlib.import_module(f"{package}.functional")
    kernels = [
        importlib.import_module(f"{package}.kernels.{name}")
        for name in ("backward", "common", "compose", "launch", "norm", "norm_pass")
    ]
    backward, common, compose, launch, norm, norm_pass = kernels
    norm_group = importlib.import_module(f"{package}.norm_group")
    launchers = [
        v
        for mod in (backward, compose, norm, norm_pass)
        for v in vars(mod).values()
        if isinstance(v, launch.Launcher)
    ]
    real_resolve = functional.resolve_impl

    def resolve(impl, x, d_out):  # the rule's own host work, then the GPU's answer
        chosen = real_resolve("eager" if impl == "eager" else "auto", x, d_out)
        return chosen if impl == "eager" else "fused"

    class _Config:  # common.config, with the launchability check's CPU test passing
        def __getattr__(self, name):
            return getattr(launch.config, name)

        @staticmethod
        def interpreting():
            return True

    fake_driver = types.SimpleNamespace(
        active=types.SimpleNamespace(get_current_stream=lambda device: 0)
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(functional, "resolve_impl", resolve))
        for mod in (common, norm_pass):  # launchability, and the one-pass norm's CUDA test
            stack.enter_context(mock.patch.object(mod, "config", _Config()))
        stack.enter_context(mock.patch.object(launch, "driver", fake_driver))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        for launcher in launchers:
            stack.enter_context(mock.patch.object(launcher, "kernel", _NoopKernel()))
            stack.enter_context(mock.patch.object(launcher, "_compiled", {}))
        if hasattr(norm_group, "graphs_possible"):  # the group's replay path, as on CUDA
            stack.enter_context(
                mock.patch.object(
                    norm_group, "graphs_possible", lambda w: norm_group.config.NORM_GROUP_GRAPHS
                )
            )
        yield launchers


def _replays(model) -> int:
    """Replays of the norm groups of ``model``'s DoRA layers."""
    caches = (getattr(m, "_dora_norm_cache", None) for m in model.modules())
    groups = {id(c.group): c.group for c in caches if c is not None and c.group is not None}
    return sum(g.replays for g in groups.values())


def tiny_model(layers: int, hidden: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def build(variant: str, layers: int, hidden: int, r: int, rev=None):
    """One variant's model (bf16 adapters, ``autocast_adapter_dtype=False``), in train mode.
    ``rev``: the package ``ours_rev`` accelerates with."""
    from peft import LoraConfig, get_peft_model

    import dora_torch

    dora = variant != "peft_lora"
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=ADAPTED, use_dora=dora)
    model = get_peft_model(tiny_model(layers, hidden), cfg, autocast_adapter_dtype=False)
    with torch.no_grad():  # B ≠ 0, so the adapters take part
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    if variant == "ours":
        dora_torch.accelerate_peft(model)
    elif variant == "ours_stacked":
        dora_torch.accelerate_peft(model, stack_modules=".*")
    elif variant == "ours_rev":
        rev.accelerate_peft(model)
    return model.train()


def step_fn(model, ids, optimizer: bool = False):
    """One fwd+bwd (and, with ``optimizer``, an ``AdamW(foreach=True)`` step over the
    trainable parameters); returns (forward, backward, optimizer) seconds."""
    opt = None
    if optimizer:
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)

    def step():
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = model(input_ids=ids).logits.float().square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if opt is not None:
            opt.step()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    return step


def hook_step_fn(model, ids, package: str):
    """The optimizer-step hook of ``package`` (``cache._count_step``: every cached module's
    buffers brought up to date, run after each optimizer step), timed alone on ``model``'s
    layers after one fwd+bwd filled their caches; returns (hook seconds, 0)."""
    step_fn(model, ids)()
    cache = importlib.import_module(f"{package}.cache")
    hook = cache._count_step
    if not any(m in cache._cached_modules for m in model.modules()):
        raise RuntimeError(f"{package}'s step hook sees none of the model's layers")

    def step(model=model):  # the hook's module set is weak: the model must stay alive
        t0 = time.perf_counter()
        hook(None, (), {})
        return time.perf_counter() - t0, 0.0, 0.0

    return step


def guard_step_fn(model, ids):
    """Dynamo's guard check of ``torch.compile(model)``'s forward, timed alone; returns
    (check seconds, 0, 0). Raises when the compiled forward is not one graph or its guards
    reject the call they were built for (the harness would time something else)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    forward = type(model).forward
    before = len(_debug_get_cache_entry_list(forward.__code__))
    torch.compile(model, backend="eager")(input_ids=ids)
    entries = _debug_get_cache_entry_list(forward.__code__)
    if len(entries) != before + 1:
        raise RuntimeError(f"compiling {type(model).__name__} made {len(entries) - before} "
                           "cache entries, not one graph: the harness is stale")  # fmt: skip
    bound = inspect.signature(forward).bind(model, input_ids=ids)
    bound.apply_defaults()
    frame_locals = dict(bound.arguments)
    check = entries[0].guard_manager.check  # the newest entry
    if not check(frame_locals):
        raise RuntimeError("the guards reject the call they were built for: the harness is stale")

    def step(model=model):
        t0 = time.perf_counter()
        check(frame_locals)
        return time.perf_counter() - t0, 0.0, 0.0

    return step


def layer_step_fn(variant: str, d: int, r: int, tokens: int, rev=None):
    """One fwd+bwd of one layer (``bench_torch_layer``'s eager fwd_bwd row): ``lora_eq`` =
    cuBLAS LoRA (two GEMMs and an addmm), ``ours`` / ``ours_rev`` = ``dora_torch.Linear``
    with lora_A's version bumped first (an update: the norm is recomputed in the call);
    ``ours_stacked`` the same with ``stack_weights=True``."""
    from torch import nn

    import dora_torch

    torch.manual_seed(0)
    dt = torch.bfloat16
    base = nn.Linear(d, d, bias=False, dtype=dt).requires_grad_(False)
    x = torch.randn(tokens, d, dtype=dt, requires_grad=True)
    dy = torch.randn(tokens, d, dtype=dt)
    if variant == "lora_eq":
        w = base.weight
        a = nn.Parameter(torch.randn(r, d, dtype=dt) / d**0.5)
        b = nn.Parameter(torch.randn(d, r, dtype=dt) * 0.01)

        def forward():
            return torch.addmm(torch.mm(x, w.t()), torch.mm(x, a.t()), b.t(), alpha=2.0)

    else:
        package = rev if variant == "ours_rev" else dora_torch
        stack = {"stack_weights": True} if variant == "ours_stacked" else {}
        layer = package.Linear.from_linear(base, r=r, lora_alpha=2 * r, adapter_dtype=dt, **stack)
        with torch.no_grad():
            layer.lora_B.normal_(0.0, 0.02)

        def forward():
            torch.autograd.graph.increment_version(layer.lora_A)
            return layer(x)

    def step():
        t0 = time.perf_counter()
        y = forward()
        t1 = time.perf_counter()
        y.backward(dy)
        return t1 - t0, time.perf_counter() - t1, 0.0

    return step


def timed_rounds(steps: dict, rounds: int, per_round: int) -> dict[str, list[tuple]]:
    """Per variant, per round: the mean (forward, backward, optimizer) seconds of
    ``per_round`` steps.
    Every other round runs the variants in reverse order (a variant's position in a round
    moved its time by up to 5 µs per call in A/A runs)."""
    out = {v: [] for v in steps}
    order = list(steps.items())
    gc.disable()  # a collection inside one variant's turn would be charged to it
    try:
        for k in range(rounds):
            for v, fn in order if k % 2 == 0 else order[::-1]:
                total = [0.0, 0.0, 0.0]
                for _ in range(per_round):
                    total = [t + x for t, x in zip(total, fn(), strict=True)]
                out[v].append(tuple(t / per_round for t in total))
    finally:
        gc.enable()
    return out


def summary(times: dict[str, list[tuple]], calls: int, base_variant="peft_lora") -> list[dict]:
    """Medians in ms, and the excess per adapted layer call over ``base_variant`` in µs."""
    rows = []
    for v, ts in times.items():
        fwd, bwd, opt = (statistics.median(t[i] for t in ts) for i in (0, 1, 2))
        rows.append({"variant": v, "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3, "opt_ms": opt * 1e3})
    base = next((r for r in rows if r["variant"] == base_variant), None)
    for r in rows:
        for k in ("fwd", "bwd", "opt"):
            extra = None if base is None else (r[f"{k}_ms"] - base[f"{k}_ms"]) * 1e3 / calls
            r[f"{k}_excess_us_per_layer"] = extra
    return rows


#: Per workload: its variants (the first is the baseline the excess is counted against).
WORKLOAD_VARIANTS = {
    "model": ("peft_lora", "ours", "peft_dora", "ours_stacked"),
    "train_step": ("peft_lora", "ours", "peft_dora"),
    "layer": ("lora_eq", "ours", "ours_stacked"),
    "step_hook": ("ours",),
    "guards": ("peft_lora", "ours"),
}


def main(argv=None) -> list[dict]:
    from benchmarks.measure import add_round_args, round_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="model", choices=tuple(WORKLOAD_VARIANTS))
    ap.add_argument("--variants", nargs="+", choices=VARIANTS,
                    help="default: the workload's (model: peft_lora ours peft_dora ours_stacked; "
                    "layer: lora_eq ours ours_stacked); the first is the baseline")  # fmt: skip
    ap.add_argument(
        "--rev",
        metavar="DIR",
        type=pathlib.Path,
        help="also time `benchmarks.revision_copy`'s copy in DIR (ours_rev)",
    )
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (model workload)")
    ap.add_argument("--hidden", type=int, default=16, help="tiny: GEMMs cost ~1 µs, as launches")
    ap.add_argument("--seq", type=int, default=4, help="tokens")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--profile", metavar="VARIANT", help="print a cProfile of this variant")
    add_round_args(ap, rounds=25, per_round=10)
    args = ap.parse_args(argv)
    rounds = round_args(ap, args)
    allowed = WORKLOAD_VARIANTS[args.workload]
    variants = list(args.variants or allowed)
    wrong = [v for v in variants if v not in allowed]
    if wrong:
        ap.error(f"--variants {wrong}: not variants of --workload {args.workload} ({allowed})")
    from dora_torch import config

    if config.interpreting():  # interpreted kernels never take the Launcher's fast path
        ap.error("run without TRITON_INTERPRET=1: the harness times the CUDA launch path")
    rev, packages = None, ["dora_torch"]
    if args.rev is not None:
        from benchmarks.revision_copy import load

        rev, commit = load(args.rev)
        variants.append("ours_rev")
        packages.append(rev.__name__)
        print(f"ours_rev: dora_torch at {commit}")
        replays = hasattr(importlib.import_module(f"{rev.__name__}.norm_group"), "graphs_possible")
        if args.workload == "train_step" and not replays:
            print("note: ours_rev's norm group computes its members one by one here (no "
                  "graphs_possible): its forward is not comparable with ours'")  # fmt: skip
    if args.profile is not None and args.profile not in variants:
        ap.error(f"--profile {args.profile}: not among the variants {variants}")
    torch.set_num_threads(1)
    # Dynamo traces the layers: on the CPU tier, not through the no-op launches
    guards = args.workload == "guards"
    with contextlib.nullcontext([]) if guards else fused_host_path(packages) as launchers:
        models = {}
        if args.workload in ("model", "train_step"):
            ids = torch.randint(0, 128, (1, args.seq))
            calls = args.layers * len(ADAPTED)
            models = {v: build(v, args.layers, args.hidden, args.rank, rev) for v in variants}
            steps = {
                v: step_fn(model, ids, optimizer=args.workload == "train_step")
                for v, model in models.items()
            }
        elif args.workload == "step_hook":
            ids = torch.randint(0, 128, (1, args.seq))
            calls = args.layers * len(ADAPTED)
            steps = {
                v: hook_step_fn(build(v, args.layers, args.hidden, args.rank, rev), ids,
                                packages[-1] if v == "ours_rev" else "dora_torch")
                for v in variants
            }  # fmt: skip
        elif guards:
            ids = torch.randint(0, 128, (1, args.seq))
            calls = args.layers * len(ADAPTED)
            steps = {
                v: guard_step_fn(build(v, args.layers, args.hidden, args.rank, rev), ids)
                for v in variants
            }
        else:
            calls = 1
            steps = {v: layer_step_fn(v, args.hidden, args.rank, args.seq, rev) for v in variants}
        for fn in steps.values():  # warm-up: caches, Launcher keys
            for _ in range(3):
                fn()
        ours = {"ours", "ours_rev", "ours_stacked"} & set(steps)
        if ours and not guards and not any(x.fast_launches for x in launchers):
            raise RuntimeError("ours never reached a Launcher's fast path: the harness is stale")
        if args.workload == "train_step" and "ours" in models and not _replays(models["ours"]):
            raise RuntimeError("ours' norm group never replayed: the harness is stale")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(rounds["per_round"]):
                steps[args.profile]()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            return []
        times = timed_rounds(steps, rounds["rounds"], rounds["per_round"])
    rows = summary(times, calls, variants[0])
    what = {
        "model": f"one fwd+bwd, {args.layers} layers × 7 adapted projections, hidden {args.hidden}",
        "layer": f"one fwd+bwd, one {args.hidden}² layer, norm recomputed per call (ours)",
        "train_step": f"one training step (zero_grad, fwd, bwd, AdamW foreach), {args.layers} "
        f"layers × 7 adapted projections, hidden {args.hidden}",
        "step_hook": f"the optimizer-step hook ('fwd' column), {args.layers} layers × 7 adapted "
        "projections",
        "guards": f"the compiled forward's guard check ('fwd' column), {args.layers} layers × 7 "
        "adapted projections",
    }[args.workload]
    path = "the layers on their CPU tier" if guards else "the fused tier's launches as no-ops"
    print(
        f"host time of {what}, {args.seq} tokens, r = {args.rank}, bf16, {path}; medians of "
        f"{rounds['rounds']} rounds × {rounds['per_round']} steps"
    )
    opt = args.workload == "train_step"
    print(f"{'variant':<10} {'fwd µs':>9} {'bwd µs':>9}" + (f" {'opt µs':>9}" if opt else "")
          + f"   excess over {variants[0]}, µs per layer call")  # fmt: skip
    for r in rows:
        fx, bx, ox = (r[f"{k}_excess_us_per_layer"] for k in ("fwd", "bwd", "opt"))
        times = f"{r['fwd_ms'] * 1e3:9.1f} {r['bwd_ms'] * 1e3:9.1f}"
        times += f" {r['opt_ms'] * 1e3:9.1f}" if opt else ""
        extra = ""
        if fx is not None:
            extra = f"   fwd {fx:+6.1f}  bwd {bx:+6.1f}" + (f"  opt {ox:+6.1f}" if opt else "")
            extra += f"  sum {fx + bx + (ox if opt else 0.0):+6.1f}"
        print(f"{r['variant']:<10} {times}{extra}")
    return rows


if __name__ == "__main__":
    main()
