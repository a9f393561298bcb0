"""Block configs of the one-pass norm kernel (``dora_torch/kernels/norm_pass.py``) on the
weight shapes of one Llama-8B decoder layer, r = 16, bf16.

For every (BLOCK_M, BLOCK_D, warps, stages) in ``CONFIGS``: the kernel's time on each shape,
without ‖W‖² cached (what a compiled training graph runs every forward) and, for the fastest
configs, with it cached (the eager norm group); its error against a float64 norm, so a config
that runs fast but wrong is never chosen; and the bandwidth it reaches (W's bytes over its
time). Beside them, the norm as the fused tier computes it with the pass off (``‖W‖²``, the
U and G GEMMs, the assembly). Writes ``norm_pass_configs.csv`` and prints the best config by
a layer's total time (shapes weighted by how often a layer has them) as a line
``BEST NORM_PASS_BLOCKS=(...)``.

    python3 -m benchmarks.bench_norm_pass [--rank 16] [--top 6]
"""

from __future__ import annotations

import argparse
import os
import pathlib

from benchmarks.measure import write_csv

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False

#: (d_out, d_in) of the seven projections of a Llama-8B layer, and how many of each.
LAYER_SHAPES = {(4096, 4096): 2, (1024, 4096): 2, (14336, 4096): 2, (4096, 14336): 1}
CONFIGS = [
    (bm, bd, warps, stages)
    for bm in (16, 32, 64, 128)
    for bd in (64, 128, 256)
    for warps in (4, 8)
    for stages in (3, 4)
    if bm * bd <= 16384
]
MAX_REL_ERR = 1e-4  # fp32 accumulation of a 16-bit W: ~1e-6 in practice


def weights_of(d_out, d_in, r):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    W = torch.randn(d_out, d_in, device="cuda", generator=g).to(torch.bfloat16) / d_in**0.5
    A = (torch.randn(r, d_in, device="cuda", generator=g) / d_in**0.5).to(torch.bfloat16)
    B = torch.randn(d_out, r, device="cuda", generator=g) * 0.05
    return W, A, B


def reference_norm(W, A, B, s):
    V = W.double() + s * (B.double() @ A.double())
    return V.norm(dim=1)


def rel_err(n, ref) -> float:
    return ((n.double() - ref).abs() / ref).max().item()


def sweep(rank: int = 16, top: int = 6, s: float = 2.0) -> tuple[list[dict], tuple]:
    import torch
    import triton.testing

    from dora_torch import config
    from dora_torch.kernels.norm_pass import norm_pass
    from dora_torch.norm import base_sq_norm, detached_norm

    def bench(f):
        return triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")

    data = {shape: weights_of(*shape, rank) for shape in LAYER_SHAPES}
    refs = {shape: reference_norm(*data[shape], s) for shape in LAYER_SHAPES}
    cached = {shape: base_sq_norm(data[shape][0]) for shape in LAYER_SHAPES}
    rows, totals = [], {}
    saved = (config.NORM_PASS_BLOCKS, config.NORM_PASS_MAX_RANK)
    try:
        with torch.no_grad():
            config.NORM_PASS_MAX_RANK = 0  # the fused tier's norm without the pass
            for shape, (W, A, B) in data.items():
                offs = (("off, ‖W‖² computed", None), ("off, ‖W‖² cached", cached[shape]))
                for label, bsq in offs:
                    ms = bench(lambda W=W, A=A, B=B, bsq=bsq: detached_norm(W, A, B, bsq, s, True))
                    rows.append({"d_out": shape[0], "d_in": shape[1], "r": rank,
                                 "what": label, "ms": ms})  # fmt: skip
            for cfg in CONFIGS:
                config.NORM_PASS_BLOCKS = cfg
                total, worst = 0.0, 0.0
                for shape, (W, A, B) in data.items():
                    err = rel_err(norm_pass(W, A, B, None, s), refs[shape])
                    ms = bench(lambda W=W, A=A, B=B: norm_pass(W, A, B, None, s))
                    gbps = W.numel() * W.element_size() / (ms * 1e-3) / 1e9
                    rows.append({"d_out": shape[0], "d_in": shape[1], "r": rank,
                                 "what": "pass, ‖W‖² computed", "config": cfg, "ms": ms,
                                 "GBps": gbps, "max_rel_err": err})  # fmt: skip
                    total += LAYER_SHAPES[shape] * ms
                    worst = max(worst, err)
                totals[cfg] = total if worst <= MAX_REL_ERR else float("inf")
                print(f"[norm_pass] {cfg}: layer {total * 1e3:.1f} µs, max rel err {worst:.1e}",
                      flush=True)  # fmt: skip
            best = sorted(totals, key=totals.get)[:top]
            for cfg in best:
                config.NORM_PASS_BLOCKS = cfg
                for shape, (W, A, B) in data.items():
                    bsq = cached[shape]
                    err = rel_err(norm_pass(W, A, B, bsq, s), refs[shape])
                    ms = bench(lambda W=W, A=A, B=B, bsq=bsq: norm_pass(W, A, B, bsq, s))
                    rows.append({"d_out": shape[0], "d_in": shape[1], "r": rank,
                                 "what": "pass, ‖W‖² cached", "config": cfg, "ms": ms,
                                 "max_rel_err": err})  # fmt: skip
    finally:
        config.NORM_PASS_BLOCKS, config.NORM_PASS_MAX_RANK = saved
    for what in ("off, ‖W‖² computed", "off, ‖W‖² cached"):
        layer = sum(LAYER_SHAPES[(r["d_out"], r["d_in"])] * r["ms"] for r in rows
                    if r["what"] == what)  # fmt: skip
        print(f"[norm_pass] {what}: layer {layer * 1e3:.1f} µs", flush=True)
    return rows, best[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--top", type=int, default=6, help="configs also timed with ‖W‖² cached")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench")
    args = ap.parse_args(argv)
    rows, best = sweep(args.rank, args.top)
    write_csv(pathlib.Path(args.out) / "norm_pass_configs.csv", rows)
    print(f"BEST NORM_PASS_BLOCKS={best}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
