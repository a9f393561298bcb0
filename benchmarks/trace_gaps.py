"""Where the GPU waits for the host: idle gaps of a profiled training step's timeline.

Reads a Chrome trace written by ``bench_model_torch --profile`` (``*.trace.json.gz``: three
steps, each inside a ``train_step`` range) and reports, per step, the host span, the GPU's
busy and idle time between the step's first and last kernel, the host time before the first
kernel started (Dynamo's guards, the graph tree's input checks before a replay) and after the
last one ended, and the idle time grouped by
what the host was doing when it launched the kernel that ended each gap (the innermost CPU
op around that launch, and its outermost ancestor inside the step). A step whose idle time
is large is host-bound; the groups say which host work to cut. ``--kernels`` also prints the
GPU time per kernel family (cuBLAS GEMMs, Inductor's kernels, each of ours), averaged over
the steps, to diff two providers.

    python3 -m benchmarks.trace_gaps out/bench/profile_ours_bf16_compile_r384_b1.trace.json.gz
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re

from benchmarks.bench_model_torch import TRACE_STEP

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kernel_family(name: str) -> str:
    """A kernel's family: cuBLAS GEMMs, Inductor pointwise / reductions, the optimizer's
    foreach kernels, attention, or the kernel's own name without a numeric suffix."""
    base = re.sub(r"_\d+$", "", name)
    rules = (
        (("nvjet", "cutlass", "gemm", "splitKreduce"), "cuBLAS GEMMs"),
        (("triton_poi",), "Inductor pointwise"),
        (("triton_red", "triton_per"), "Inductor reductions"),
        (("multi_tensor_apply",), "foreach (optimizer)"),
        (("sdpa", "cudnn", "flash"), "attention"),
    )
    for needles, family in rules:
        if any(n in base for n in needles) and not base.startswith("_"):
            return family
    return base


def _enclosing(ops: list[dict], starts: list[float], t: float) -> list[dict]:
    """CPU ops (of one thread, sorted by start) whose span contains time t, outermost first."""
    out = [op for op in ops[: bisect.bisect_right(starts, t)] if op["ts"] + op.get("dur", 0) >= t]
    return sorted(out, key=lambda op: (op["ts"], -op.get("dur", 0)))


def analyse(events: list[dict], min_gap_us: float = 5.0):
    steps = sorted(
        (e for e in events if e.get("name") == TRACE_STEP and e.get("cat") == "user_annotation"),
        key=lambda e: e["ts"],
    )
    kernels = sorted(
        (e for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X"),
        key=lambda e: e["ts"],
    )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    cpu_ops = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and e.get("ph") == "X":
            cpu_ops[e["tid"]].append(e)
    for ops in cpu_ops.values():
        ops.sort(key=lambda op: op["ts"])
    starts = {tid: [op["ts"] for op in ops] for tid, ops in cpu_ops.items()}

    results = []
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        mine = []
        for k in kernels:
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is not None and lo <= launch["ts"] <= hi:
                mine.append((k, launch))
        if not mine:
            continue
        busy = idle = 0.0
        end = mine[0][0]["ts"]
        by_inner, by_outer = collections.Counter(), collections.Counter()
        families = collections.Counter()
        for k, launch in mine:
            families[kernel_family(k["name"])] += k["dur"]
            gap = k["ts"] - end
            if gap > min_gap_us:
                idle += gap
                chain = _enclosing(cpu_ops[launch["tid"]], starts[launch["tid"]], launch["ts"])
                chain = [op for op in chain if op["name"] != TRACE_STEP]
                by_inner[chain[-1]["name"] if chain else "?"] += gap
                by_outer[chain[0]["name"] if chain else "?"] += gap
            busy += max(0.0, k["ts"] + k["dur"] - max(end, k["ts"]))
            end = max(end, k["ts"] + k["dur"])
        results.append({
            "host_ms": step["dur"] / 1e3,
            "gpu_span_ms": (end - mine[0][0]["ts"]) / 1e3,
            "gpu_busy_ms": busy / 1e3,
            "gpu_idle_ms": idle / 1e3,
            # the host's work before the step's first kernel, and after its last one ended
            "lead_in_ms": (mine[0][0]["ts"] - lo) / 1e3,
            "tail_ms": (hi - end) / 1e3,
            "kernels": len(mine),
            "idle_by_inner": by_inner,
            "idle_by_outer": by_outer,
            "gpu_us_by_family": families,
        })  # fmt: skip
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--kernels", action="store_true", help="GPU time per kernel family too")
    args = ap.parse_args()
    for path in args.traces:
        print(f"== {path}")
        steps = analyse(load(path), args.min_gap_us)
        if args.kernels and steps:
            total = collections.Counter()
            for r in steps:
                total.update(r["gpu_us_by_family"])
            print(f"GPU ms per step by kernel family (mean of {len(steps)} steps):")
            for name, us in total.most_common():
                print(f"  {us / len(steps) / 1e3:8.3f}  {name[:100]}")
        for i, r in enumerate(steps):
            print(
                f"step {i}: host {r['host_ms']:.2f} ms, GPU span {r['gpu_span_ms']:.2f}, busy "
                f"{r['gpu_busy_ms']:.2f}, idle {r['gpu_idle_ms']:.2f} ms, {r['kernels']} kernels; "
                f"before the first kernel {r['lead_in_ms']:.2f} ms, after the last "
                f"{r['tail_ms']:.2f} ms"
            )
            groups = (("outermost", r["idle_by_outer"]), ("innermost", r["idle_by_inner"]))
            for title, counter in groups:
                print(f"  idle by the {title} host op that launched the next kernel:")
                for name, us in counter.most_common(args.top):
                    print(f"    {us / 1e3:8.3f} ms  {name[:100]}")


if __name__ == "__main__":
    main()
