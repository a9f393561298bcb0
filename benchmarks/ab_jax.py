"""One-process A/B of the working tree's dora_jax against an earlier revision's copy: the bench
model's training step, or one layer's forward or gradient, timed in alternating rounds, and
with ``--profile`` the GPU time per HLO op of each program, compared by (opcode, fusion kind,
shape).

Steps of one code spread by several percent between processes (and machines) on the lent
GPUs, so a change is judged against the code before it in the same process
(benchmarks/NOTES.md, sessions 16-19 and 23-24). The copy is ``revision_copy``'s: a package
``dora_jax_rev`` sharing no module with the tree's ``dora_jax``. The model's weights are drawn once
(``bench_model_jax.build_base``) and shared by one model per package, each built from that
package's own ``models.llama`` (so a change to the twin is timed too) and adapted by it;
a layer takes ``bench_jax_layer``'s inputs and ``functional.dora_dense`` (``--impl``, by
default "xla"; ``base_sq`` given, as the layer bench's ``ours_xla``). Each round calls every variant
``--calls`` times in turn (the round's median per variant), and the paired per-round
difference tree − rev is reported with the medians.

Each side is compiled once, and XLA autotunes every compile: an A/A (``--rev`` a copy of the
tree itself) read −0.24 and +0.42 ms on the 8-layer r = 16 and r = 384 steps (run 125). A
paired difference below ~0.5 ms there is within that spread; repeat the A/B, or run the A/A
beside it, before deciding on one.

    python3 -m benchmarks.revision_copy HEAD~1 --package dora_jax --dest .rev_jax   # here
    python3 -m benchmarks.ab_jax --rev .rev_jax --model 384 8                    # on the device
    python3 -m benchmarks.ab_jax --rev .rev_jax --layer 8192x28672_r384_t2048 --kind fwd --profile

(carry ``.rev_jax`` to the device). Op names differ between two compiled programs, so the
profile compares sums over (opcode, kind, shape) rather than ops. ``--profile`` switches XLA's
command buffers off for the whole process (``profile_jax.disable_command_buffers``: with them
on, a program's kernels are traced under one command-buffer op that no HLO instruction names),
so its timed rounds run without command buffers too; compare them with runs of their own kind.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import statistics
import sys
from collections import defaultdict

from benchmarks import profile_jax as pj
from benchmarks.measure import jax_time_rounds, write_csv

TAGS = ("tree", "rev")
UNKNOWN_OP = dict(opcode="?", kind="", shape="")  # a traced op the program's HLO does not name
_LAYER = re.compile(r"(\d+)x(\d+)_r(\d+)_t(\d+)")


def parse_layer(name: str) -> tuple[int, int, int, int]:
    """(d_in, d_out, r, tokens) from a layer name such as ``8192x28672_r384_t2048``."""
    m = _LAYER.fullmatch(name)
    if m is None:
        raise ValueError(
            f"--layer must look like D_INxD_OUT_rR_tT (e.g. 8192x8192_r384_t4096); got {name!r}"
        )
    return tuple(int(v) for v in m.groups())


def model_programs(
    packages: dict, *, rank: int, layers: int, tiny: bool, batch: int | None = None
) -> dict:
    """tag -> (compiled training step, call): the bench model adapted by each package, on
    ``batch`` sequences per step (None: ``bench_model_jax.BATCH``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks import bench_model_jax as bm

    base = bm.build_base(layers, tiny=tiny)
    vocab, seq = bm.vocab_and_seq(tiny)
    batch = bm.BATCH if batch is None else batch
    ids = jax.random.randint(jax.random.key(0), (batch, seq), 0, vocab, dtype=jnp.int32)
    state = nnx.state(base)
    out = {}
    for tag, package in packages.items():
        # each package's own model code (its llama twin calls its own swiglu), the weights shared
        model = nnx.eval_shape(lambda p=package: bm.build_base(layers, tiny=tiny, package=p))
        nnx.update(model, state)
        bm.adapt(model, "ours_bf16", rank, package=package)
        _, value_and_grad, adapters, rest = bm.step_functions(model)
        train, st = bm.train_step(value_and_grad, adapters)
        compiled = train.lower(st[0], st[1], rest, ids).compile()

        def call(compiled=compiled, st=st, rest=rest):
            st[0], st[1], loss = compiled(st[0], st[1], rest, ids)
            return loss

        out[tag] = (compiled, call)
    return out


def layer_programs(packages: dict, *, layer: str, kind: str, impl: str = "xla") -> dict:
    """tag -> (compiled program, call): one layer's forward or (y, VJP) from each package,
    with ``impl`` ("xla" by default, as the layer bench's ``ours_xla``; "auto" lets each
    package's own ``AUTO_MOSAIC`` table decide)."""
    import jax

    from benchmarks import bench_jax_layer as bl

    if kind not in ("fwd", "grad"):
        raise ValueError(f"--kind must be 'fwd' or 'grad'; got {kind!r}")
    d_in, d_out, r, tokens = parse_layer(layer)
    kernel, a, b, m, bias, xs, dys = bl._inputs(d_in, d_out, r, tokens, seed=0)
    out = {}
    for tag, package in packages.items():
        functional = importlib.import_module(package.__name__ + ".functional")
        norm = importlib.import_module(package.__name__ + ".norm")
        base_sq = jax.block_until_ready(jax.jit(norm.base_sq_norm)(kernel))

        def f(x, a, b, m, functional=functional, base_sq=base_sq):
            return functional.dora_dense(
                x, kernel, a, b, m, bl.SCALING, bias, impl=impl, base_sq=base_sq
            )

        if kind == "fwd":
            fn, args = bl._fwd(f), (xs[0], a, b, m)
        else:
            fn, args = bl._grad(f), (xs[0], dys[0], a, b, m)
        compiled = fn.lower(*args).compile()
        out[tag] = (compiled, lambda compiled=compiled, args=args: compiled(*args))
    return out


def profile_by_shape(compiled, call, *, steps: int) -> dict[tuple[str, str, str], float]:
    """(opcode, kind, shape) -> device µs per call of ``compiled`` (``profile_jax``'s trace)."""
    import jax

    hlo = compiled.as_text()
    module = re.search(r"HloModule\s+([\w.\-]+)", hlo)
    on_cpu = jax.default_backend() == "cpu"
    times, _ = pj.profile_step(
        call,
        steps=steps,
        module=module.group(1) if module else None,
        device_prefix="/host:CPU" if on_cpu else "/device:",
    )
    ops = pj.hlo_op_table(hlo)
    out = defaultdict(float)
    for op, (_, ns) in times.items():
        info = ops.get(op, UNKNOWN_OP)
        out[(info["opcode"], info["kind"], info["shape"])] += ns / steps / 1e3
    return dict(out)


def unlabelled_share(by_shape: dict) -> float:
    """Fraction of a profile's device time on ops its program's HLO does not name."""
    total = sum(by_shape.values())
    unknown = by_shape.get((UNKNOWN_OP["opcode"], UNKNOWN_OP["kind"], UNKNOWN_OP["shape"]), 0.0)
    return unknown / total if total else 0.0


def shape_differences(tree: dict, rev: dict) -> list[tuple[tuple[str, str, str], float, float]]:
    """[(key, tree µs, rev µs)] over the union of keys, largest |tree − rev| first."""
    keys = set(tree) | set(rev)
    rows = [(k, tree.get(k, 0.0), rev.get(k, 0.0)) for k in keys]
    return sorted(rows, key=lambda row: -abs(row[1] - row[2]))


def report(times: dict, label: str) -> list[str]:
    lines = [
        f"{label} {tag}: median {statistics.median(ts):.3f} ms, rounds {[round(t, 3) for t in ts]}"
        for tag, ts in times.items()
    ]
    paired = [t - r for t, r in zip(times["tree"], times["rev"])]
    lines.append(f"{label} paired tree - rev: median {statistics.median(paired):+.3f} ms")
    return lines


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rev", required=True, help="directory written by revision_copy --package dora_jax"
    )
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", nargs=2, type=int, metavar=("RANK", "LAYERS"))
    what.add_argument("--layer", help="D_INxD_OUT_rR_tT, e.g. 8192x28672_r384_t2048")
    ap.add_argument("--kind", default="fwd", help="layer: fwd or grad")
    ap.add_argument(
        "--impl", default="xla", choices=("xla", "auto", "mosaic"), help="layer: dora_dense's impl"
    )
    ap.add_argument("--tiny", action="store_true", help="model: the small config (CPU tests)")
    ap.add_argument("--batch", type=int, default=None, help="model: sequences per step")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=5, help="timed calls per variant per round")
    ap.add_argument("--profile", action="store_true", help="also GPU µs per (opcode, kind, shape)")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="directory for the CSVs")
    args = ap.parse_args(argv)
    if args.layer is not None:
        parse_layer(args.layer)  # a bad name fails before anything is built

    import dora_jax
    from benchmarks.revision_copy import load

    rev, commit = load(pathlib.Path(args.rev), package="dora_jax")
    packages = dict(zip(TAGS, (dora_jax, rev)))
    if args.model is not None:
        rank, layers = args.model
        label = f"model r={rank} {layers}L" + (f" batch {args.batch}" if args.batch else "")
        programs = model_programs(
            packages, rank=rank, layers=layers, tiny=args.tiny, batch=args.batch
        )
    else:
        label = f"{args.layer} {args.kind}"
        programs = layer_programs(packages, layer=args.layer, kind=args.kind, impl=args.impl)
    calls = {tag: call for tag, (_, call) in programs.items()}
    times = jax_time_rounds(calls, rounds=args.rounds, per_round=args.calls)
    print(f"tree against rev {commit}")
    for line in report(times, label):
        print(line)
    result = dict(times=times, commit=commit)
    rows = [
        dict(what=label, variant=tag, round=i, ms=t)
        for tag, ts in times.items()
        for i, t in enumerate(ts)
    ]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "ab_jax.csv", rows)
    if args.profile:
        by_shape = {
            tag: profile_by_shape(compiled, call, steps=args.profile_steps)
            for tag, (compiled, call) in programs.items()
        }
        diffs = shape_differences(by_shape["tree"], by_shape["rev"])
        total = {tag: sum(v.values()) for tag, v in by_shape.items()}
        print(f"{label} device µs per call: tree {total['tree']:.1f}, rev {total['rev']:.1f}")
        for tag, v in by_shape.items():
            if unlabelled_share(v) > 0.5:
                print(
                    f"  warning: {unlabelled_share(v):.0%} of {tag}'s device time is on ops its "
                    "HLO does not name (command buffers on? run ab_jax as a script, or set "
                    f"XLA_FLAGS={pj.NO_COMMAND_BUFFERS} before JAX starts)"
                )
        for (opcode, kind, shape), t, r in diffs[: args.top]:
            print(f"  {t - r:+9.1f} us  tree {t:8.1f}  rev {r:8.1f}  {opcode} {kind} {shape}")
        result["profile"] = by_shape
        if args.out is not None:
            write_csv(
                args.out / "ab_jax_profile.csv",
                [
                    dict(what=label, opcode=o, kind=k, shape=s, tree_us=t, rev_us=r)
                    for (o, k, s), t, r in diffs
                ],
            )
    return result


if __name__ == "__main__":
    if "--profile" in sys.argv[1:]:
        pj.disable_command_buffers()
    main()
