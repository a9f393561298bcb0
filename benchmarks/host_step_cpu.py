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
  - the launchability check accepts CPU tensors (the kernels would never read them).

The kernels' outputs are left as allocated (only the host time is read). The norm
follows the CPU path (the group's CUDA-graph replay needs a GPU), so the timed call is a
forward and backward with the norm cached (adapters unchanged), not the optimizer step.
Variants take turns in rounds (``measure.add_round_args``); printed: medians of the forward
and the backward, and each variant's excess over PEFT LoRA per adapted layer call, in µs.
A host-bound H200 machine ran session 19's Python savings ~2.5× slower than a CPU harness
measured them (NOTES, run 71). ``--rev DIR`` adds ``ours_rev``, a ``revision_copy`` of an
earlier commit, to the same rounds (an A/B in one process); ``--profile VARIANT`` prints a
cProfile of one variant instead (cProfile inflates Python calls several-fold: read the
rounds for sizes, the profile for names).

    python3 -m benchmarks.host_step_cpu
    python3 -m benchmarks.revision_copy HEAD --dest .rev
    python3 -m benchmarks.host_step_cpu --variants peft_lora ours --rev .rev
    python3 -m benchmarks.host_step_cpu --profile ours --per-round 20
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import importlib
import pathlib
import pstats
import statistics
import time
import types
from unittest import mock

import torch

VARIANTS = ("peft_lora", "ours", "peft_dora")
ADAPTED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _NoopCompiled:
    """What ``kernel[grid](...)`` returns to a ``Launcher``: its fast path then calls ``run``."""

    function = 0
    packed_metadata = None

    @staticmethod
    def run(*args):
        return None


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
        stack.enter_context(mock.patch.object(common, "config", _Config()))
        stack.enter_context(mock.patch.object(launch, "driver", fake_driver))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        for launcher in launchers:
            stack.enter_context(mock.patch.object(launcher, "kernel", _NoopKernel()))
            stack.enter_context(mock.patch.object(launcher, "_compiled", {}))
        yield launchers


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
    elif variant == "ours_rev":
        rev.accelerate_peft(model)
    return model.train()


def step_fn(model, ids):
    """One fwd+bwd; returns (forward seconds, backward seconds)."""

    def step():
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = model(input_ids=ids).logits.float().square().mean()
        t1 = time.perf_counter()
        loss.backward()
        return t1 - t0, time.perf_counter() - t1

    return step


def timed_rounds(steps: dict, rounds: int, per_round: int) -> dict[str, list[tuple]]:
    """Per variant, per round: the mean (forward, backward) seconds of ``per_round`` steps."""
    out = {v: [] for v in steps}
    gc.disable()  # a collection inside one variant's turn would be charged to it
    try:
        for _ in range(rounds):
            for v, fn in steps.items():
                fwd = bwd = 0.0
                for _ in range(per_round):
                    f, b = fn()
                    fwd, bwd = fwd + f, bwd + b
                out[v].append((fwd / per_round, bwd / per_round))
    finally:
        gc.enable()
    return out


def summary(times: dict[str, list[tuple]], calls: int) -> list[dict]:
    """Medians in ms, and the excess per adapted layer call over ``peft_lora`` in µs."""
    rows = []
    for v, ts in times.items():
        fwd, bwd = (statistics.median(t[i] for t in ts) for i in (0, 1))
        rows.append({"variant": v, "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3})
    base = next((r for r in rows if r["variant"] == "peft_lora"), None)
    for r in rows:
        for k in ("fwd", "bwd"):
            extra = None if base is None else (r[f"{k}_ms"] - base[f"{k}_ms"]) * 1e3 / calls
            r[f"{k}_excess_us_per_layer"] = extra
    return rows


def main(argv=None) -> list[dict]:
    from benchmarks.measure import add_round_args, round_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument(
        "--rev",
        metavar="DIR",
        type=pathlib.Path,
        help="also time `benchmarks.revision_copy`'s copy in DIR (ours_rev)",
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=16, help="tiny: GEMMs cost ~1 µs, as launches")
    ap.add_argument("--seq", type=int, default=4)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--profile", metavar="VARIANT", help="print a cProfile of this variant")
    add_round_args(ap, rounds=25, per_round=10)
    args = ap.parse_args(argv)
    rounds = round_args(ap, args)
    from dora_torch import config

    if config.interpreting():  # interpreted kernels never take the Launcher's fast path
        ap.error("run without TRITON_INTERPRET=1: the harness times the CUDA launch path")
    variants, rev, packages = list(args.variants), None, ["dora_torch"]
    if args.rev is not None:
        from benchmarks.revision_copy import load

        rev, commit = load(args.rev)
        variants.append("ours_rev")
        packages.append(rev.__name__)
        print(f"ours_rev: dora_torch at {commit}")
    if args.profile is not None and args.profile not in variants:
        ap.error(f"--profile {args.profile}: not among the variants {variants}")
    torch.set_num_threads(1)
    ids = torch.randint(0, 128, (1, args.seq))
    calls = args.layers * len(ADAPTED)
    with fused_host_path(packages) as launchers:
        steps = {
            v: step_fn(build(v, args.layers, args.hidden, args.rank, rev), ids) for v in variants
        }
        for fn in steps.values():  # warm-up: caches, Launcher keys
            for _ in range(3):
                fn()
        if {"ours", "ours_rev"} & set(steps) and not any(x.fast_launches for x in launchers):
            raise RuntimeError("ours never reached a Launcher's fast path: the harness is stale")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(rounds["per_round"]):
                steps[args.profile]()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            return []
        times = timed_rounds(steps, rounds["rounds"], rounds["per_round"])
    rows = summary(times, calls)
    print(
        f"host time of one fwd+bwd, {args.layers} layers × 7 adapted projections, hidden "
        f"{args.hidden}, seq {args.seq}, r = {args.rank}, bf16, the fused tier's launches as "
        f"no-ops; medians of {rounds['rounds']} rounds × {rounds['per_round']} steps"
    )
    print(f"{'variant':<10} {'fwd ms':>8} {'bwd ms':>8}   excess over peft_lora, µs per layer call")
    for r in rows:
        fx, bx = r["fwd_excess_us_per_layer"], r["bwd_excess_us_per_layer"]
        extra = "" if fx is None else f"   fwd {fx:+6.1f}  bwd {bx:+6.1f}  sum {fx + bx:+6.1f}"
        print(f"{r['variant']:<10} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f}{extra}")
    return rows


if __name__ == "__main__":
    main()
