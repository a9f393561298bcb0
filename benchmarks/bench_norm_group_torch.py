"""The norm group's replay (one recomputation of every layer's norm per update) on one stream
or spread over several (``config.NORM_GROUP_STREAMS``), at the bench model's shapes (issue 10).

Members: 8 layers of Llama-8B's seven projections (``work_floor.LLAMA_8B_PROJECTIONS``) as
``dora_torch.Linear`` modules, bf16 W and adapters (PEFT's ``autocast_adapter_dtype=False``),
``lora_alpha = 2r``, in one ``NormGroup`` as ``accelerate_peft`` makes it. Per stream count:
a fresh group refreshes twice (eager, then captured), then its graph's replays are timed
alone (CUDA events, median of ``--iters`` after warm-up): the GPU time the eager step's norm
refresh takes. Every count's norms are compared with the one-stream graph's, bit for bit.

    python3 -m benchmarks.bench_norm_group_torch --ranks 16 384 --streams 1 2 4 8
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics

from benchmarks.measure import positive_int, write_csv
from benchmarks.work_floor import LLAMA_8B_PROJECTIONS

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False

FIELDS = ["date", "commit", "gpu", "rank", "layers", "streams", "replay_median_ms",
          "replay_min_ms", "vs_one_stream", "bit_equal"]  # fmt: skip


def build_members(rank: int, layers: int):
    """The DoRA layers (bf16, on CUDA) of ``layers`` decoder layers, B random."""
    import torch
    from torch import nn

    import dora_torch

    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        for d_out, d_in in LLAMA_8B_PROJECTIONS:
            base = nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=torch.bfloat16)
            layer = dora_torch.Linear.from_linear(base, r=rank, lora_alpha=2 * rank)
            with torch.no_grad():
                layer.lora_B.normal_(0, 0.01)
            modules.append(layer)
    return modules


def replay_times(group, iters: int, warmup: int = 5) -> list[float]:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        start.record()
        group._graph.replay()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(start.elapsed_time(end))
    return out


def measure(rank: int, layers: int, streams: list[int], iters: int) -> list[dict]:
    import torch

    from dora_torch import config
    from dora_torch.norm_group import group_norms

    modules = build_members(rank, layers)
    before = config.NORM_GROUP_STREAMS
    rows, first = [], None
    try:
        for k in streams:
            config.NORM_GROUP_STREAMS = k
            group = group_norms(modules)
            for _ in range(2):  # eager, then captured
                group.refresh_buffers()
            if group._graph is None:
                raise RuntimeError("the norm group did not capture its graph")
            times = replay_times(group, iters)
            norms = group._static[0].clone()
            if first is None:
                first = (statistics.median(times), norms)
            rows.append({
                "rank": rank, "layers": layers, "streams": k,
                "replay_median_ms": round(statistics.median(times), 4),
                "replay_min_ms": round(min(times), 4),
                "vs_one_stream": round(statistics.median(times) / first[0], 4),
                "bit_equal": bool(torch.equal(norms, first[1])),
            })  # fmt: skip
            print(f"[norm_group_torch] r={rank} streams={k}: replay median "
                  f"{rows[-1]['replay_median_ms']:.3f} ms (min {rows[-1]['replay_min_ms']:.3f}), "
                  f"{rows[-1]['vs_one_stream']:.3f}x of {streams[0]} stream(s), bit-equal "
                  f"{rows[-1]['bit_equal']}", flush=True)  # fmt: skip
            del group
    finally:
        config.NORM_GROUP_STREAMS = before
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=positive_int, nargs="+", default=[16, 384])
    ap.add_argument("--streams", type=positive_int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=positive_int, default=8)
    ap.add_argument("--iters", type=positive_int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench")
    args = ap.parse_args(argv)
    from benchmarks import bench_model_torch as bm

    meta, rows = bm._meta(), []
    for rank in args.ranks:
        rows += [{**meta, **row} for row in measure(rank, args.layers, args.streams, args.iters)]
        bm.free_cuda()
    write_csv(pathlib.Path(args.out) / "norm_group_torch.csv", rows, FIELDS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
