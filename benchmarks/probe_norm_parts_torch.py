"""Where one layer's detached norm spends its GPU time, part by part, at the bench model's
shapes (issue 10: the r = 384 norm-group replay took 4.96-5.64 ms per 8-layer update in run
171, against ~2 ms of tensor-core work in its U = W Aᵀ GEMMs).

Per projection shape and rank, bf16 W / A / B on CUDA, GPU time per call (``gpu_us``):
U = W Aᵀ with fp32 output (what the norm runs), the same GEMM with bf16 output, as Uᵀ = A Wᵀ
and over 2 or 4 slices of K (``split_k``: one batched GEMM of views, summed), G = A Aᵀ (also
over 4 or 8 slices), the assembly, and the whole ``detached_norm``; ``u_tflops`` is U's
achieved rate. ``--profile`` lists the kernels of one ``detached_norm`` call.

    python3 -m benchmarks.probe_norm_parts_torch --ranks 16 384
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics

from benchmarks.measure import positive_int, write_csv
from benchmarks.work_floor import LLAMA_8B_NAMES, LLAMA_8B_PROJECTIONS

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False

PARTS = ("u_fp32_out", "u_bf16_out", "u_transposed", "u_split2", "u_split4", "gram",
         "gram_split4", "gram_split8", "assemble", "detached_norm")  # fmt: skip
FIELDS = ["date", "commit", "gpu", "proj", "d_out", "d_in", "rank", *[p + "_us" for p in PARTS],
          "u_tflops"]  # fmt: skip


def gpu_us(fn, iters: int, warmup: int = 3) -> float:
    """GPU time of one ``fn()`` in µs: ``iters`` calls captured in one CUDA graph, the replay
    timed with CUDA events (median of 5 replays) and divided by ``iters``. Timing each call
    between a synchronize and an event instead (run 180) puts the host's launch latency,
    ~30 µs here, under every small kernel."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):  # Triton compiles and cuBLAS picks kernels outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def split_k(p, q, chunks: int):
    """p @ qᵀ in fp32 (p [M, K], q [N, K], 16-bit) as ``chunks`` GEMMs over slices of K in one
    batched call (views, no copies), summed: more output tiles for a GEMM whose few tiles
    leave most SMs idle (G = A Aᵀ: 9 tiles of 128² at r = 384)."""
    import torch

    k = p.shape[1] // chunks
    pv = p.view(p.shape[0], chunks, k).transpose(0, 1)
    qv = q.view(q.shape[0], chunks, k).transpose(0, 1)
    return torch.bmm(pv, qv.transpose(1, 2), out_dtype=torch.float32).sum(0)


def measure(rank: int, iters: int, profile: bool = False) -> list[dict]:
    import torch

    from dora_torch.matmul import mm_out
    from dora_torch.norm import assemble, base_sq_norm, detached_norm

    torch.manual_seed(0)
    rows, s = [], 2.0
    for name, (d_out, d_in) in zip(LLAMA_8B_NAMES, LLAMA_8B_PROJECTIONS, strict=True):
        if name in ("v_proj", "up_proj"):  # the same shapes as k_proj and gate_proj
            continue
        bf = {"device": "cuda", "dtype": torch.bfloat16}
        w = torch.randn(d_out, d_in, **bf) / d_in**0.5
        a = torch.randn(rank, d_in, **bf) / d_in**0.5
        b = torch.randn(d_out, rank, **bf) * 0.01
        base_sq = base_sq_norm(w)
        u = mm_out(w, a.t(), torch.float32)
        g = mm_out(a, a.t(), torch.float32)
        fns = {
            "u_fp32_out": lambda: mm_out(w, a.t(), torch.float32),  # noqa: B023
            "u_bf16_out": lambda: torch.mm(w, a.t()),  # noqa: B023
            "u_transposed": lambda: mm_out(a, w.t(), torch.float32),  # noqa: B023
            "u_split2": lambda: split_k(w, a, 2),  # noqa: B023
            "u_split4": lambda: split_k(w, a, 4),  # noqa: B023
            "gram_split4": lambda: split_k(a, a, 4),  # noqa: B023
            "gram_split8": lambda: split_k(a, a, 8),  # noqa: B023
            "gram": lambda: mm_out(a, a.t(), torch.float32),  # noqa: B023
            "assemble": lambda: assemble(base_sq, u, b, g, s, fused=True, bf16x3=True),  # noqa: B023
            "detached_norm": lambda: detached_norm(w, a, b, base_sq, s, True),  # noqa: B023
        }
        row = {"proj": name, "d_out": d_out, "d_in": d_in, "rank": rank}
        for part, fn in fns.items():
            if part.startswith(("u_split", "gram_split")):
                want = u if part.startswith("u") else g
                err = (fn() - want).abs().max().item() / want.abs().max().item()
                print(f"[norm_parts] r={rank} {name}: {part} {err:.1e} off the plain GEMM")
            row[part + "_us"] = round(gpu_us(fn, iters), 2)
        row["u_tflops"] = round(2 * d_out * d_in * rank / row["u_fp32_out_us"] / 1e6, 1)
        print(f"[norm_parts] r={rank} {name:9s} " + " ".join(
            f"{p} {row[p + '_us']:8.2f}" for p in PARTS) + f" | U {row['u_tflops']} TFLOP/s",
            flush=True)  # fmt: skip
        rows.append(row)
        if profile:
            print_kernels(fns["detached_norm"], f"r={rank} {name}")
    return rows


def print_kernels(fn, label: str) -> None:
    """The kernels one call of ``fn`` launches, with their GPU times (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            print(f"  [{label}] {ev.key[:90]:90s} {ev.device_time_total:9.2f} us", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=positive_int, nargs="+", default=[16, 384])
    ap.add_argument("--iters", type=positive_int, default=20, help="calls per captured graph")
    ap.add_argument("--profile", action="store_true", help="list detached_norm's kernels")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench")
    args = ap.parse_args(argv)
    from benchmarks import bench_model_torch as bm

    meta, rows = bm._meta(), []
    for rank in args.ranks:
        rows += [{**meta, **row} for row in measure(rank, args.iters, args.profile)]
    write_csv(pathlib.Path(args.out) / "norm_parts_torch.csv", rows, FIELDS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
