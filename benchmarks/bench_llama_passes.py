"""The two memory-bound passes of a DoRA layer on the shapes of one Llama-8B decoder layer at
batch 1 × 2048 tokens, r = 16, bf16, with and without the split rule
(``dora_torch.kernels.common.splits_to_fill``, on at ``config.PROGRAMS_PER_SM`` =
``--programs-per-sm``, default 2, whatever the library's default):

  - the one-pass norm (``kernels/norm_pass.py``), ‖W‖² computed and cached: d_in in slices
    (``config.NORM_PASS_SPLIT = None``) against whole rows only (``1``);
  - the backward scale-and-reduce (``kernels/backward.py``) over dy [2048, d_out]: tokens in
    as many chunks as fill the SMs ("split rule"), in chunks of ``rows_per_program`` (the
    rule off, ``PROGRAMS_PER_SM = 0``), and as before session 8 (one program per column
    block walking all 2048 tokens wherever T·d_out ≤ 2²²).

Each result is checked against float64 (a fast wrong variant is reported as such). Writes
``llama_passes.csv``; prints each layer's total (shapes weighted by how often a layer has
them).

    python3 -m benchmarks.bench_llama_passes
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import pathlib
from dataclasses import replace

from benchmarks.bench_norm_pass import LAYER_SHAPES, reference_norm, rel_err, weights_of
from benchmarks.measure import write_csv

TOKENS = 2048
#: d_out of the seven projections and how many of each (the backward pass sees dy [T, d_out]).
D_OUTS = {4096: 3, 1024: 2, 14336: 2}
MAX_REL_ERR = 1e-4


@contextlib.contextmanager
def _programs_per_sm(n: int):
    from dora_torch import config

    saved = config.PROGRAMS_PER_SM
    config.PROGRAMS_PER_SM = n
    try:
        yield
    finally:
        config.PROGRAMS_PER_SM = saved


def _bench(f):
    import triton.testing

    return triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")


def norm_rows(programs_per_sm: int, rank=16, s=2.0) -> list[dict]:
    import torch

    from dora_torch import config
    from dora_torch.kernels.norm_pass import norm_pass
    from dora_torch.norm import base_sq_norm

    rows = []
    saved = config.NORM_PASS_SPLIT
    try:
        with torch.no_grad(), _programs_per_sm(programs_per_sm):
            for shape in LAYER_SHAPES:
                W, A, B = weights_of(*shape, rank)
                ref = reference_norm(W, A, B, s)
                for cached in (False, True):
                    bsq = base_sq_norm(W) if cached else None
                    for split in (1, None):
                        config.NORM_PASS_SPLIT = split
                        err = rel_err(norm_pass(W, A, B, bsq, s), ref)
                        ms = _bench(lambda W=W, A=A, B=B, bsq=bsq: norm_pass(W, A, B, bsq, s))
                        rows.append({"pass": "norm", "d_out": shape[0], "d_in": shape[1],
                                     "cached": cached, "variant": "rows only" if split else
                                     "split rule", "ms": ms, "max_rel_err": err,
                                     "ok": err <= MAX_REL_ERR})  # fmt: skip
    finally:
        config.NORM_PASS_SPLIT = saved
    return rows


def reduce_rows(programs_per_sm: int) -> list[dict]:
    import torch

    from dora_torch import config
    from dora_torch.kernels.backward import scale_reduce

    rows = []
    before = replace(config.BWD, rows_per_program=TOKENS)  # one chunk: the old rule here
    for d_out in D_OUTS:
        g = torch.Generator(device="cuda").manual_seed(0)
        dy = torch.randn(TOKENS, d_out, device="cuda", generator=g).to(torch.bfloat16)
        inner = torch.randn(TOKENS, d_out, device="cuda", generator=g).to(torch.bfloat16)
        m = torch.rand(d_out, device="cuda", generator=g) + 0.5
        n = torch.rand(d_out, device="cuda", generator=g) + 0.5
        terms = dy.double() * inner.double()
        ref = terms.sum(0) / n.double()
        scale = terms.abs().sum(0) / n.double()
        variants = {"split rule": (None, programs_per_sm), "rule off": (None, 0)}
        if TOKENS * d_out <= 1 << 22:  # where the old rule took one chunk
            variants["one chunk (before)"] = (before, 0)
        for name, (cfg, per_sm) in variants.items():
            call = functools.partial(
                scale_reduce, dy, inner, m, n, recover=False, dropout=False, need_dbias=False,
                reduce_config=cfg,
            )  # fmt: skip
            with _programs_per_sm(per_sm):  # read at each call: the timed calls need it too
                err = ((call()[2].double() - ref).abs() / scale).max().item()
                ms = _bench(call)
            rows.append({"pass": "scale_reduce", "d_out": d_out, "tokens": TOKENS,
                         "variant": name, "ms": ms, "max_rel_err": err,
                         "ok": err <= MAX_REL_ERR})  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench")
    ap.add_argument("--programs-per-sm", type=int, default=2, help="the split rule's target")
    args = ap.parse_args(argv)
    rows = norm_rows(args.programs_per_sm) + reduce_rows(args.programs_per_sm)
    for row in rows:
        print(f"[llama_passes] {row}", flush=True)
    for cached in (False, True):
        for variant in ("rows only", "split rule"):
            total = sum(LAYER_SHAPES[(r["d_out"], r["d_in"])] * r["ms"] for r in rows
                        if r["pass"] == "norm" and r["cached"] == cached
                        and r["variant"] == variant)  # fmt: skip
            print(f"[llama_passes] norm, ‖W‖² {'cached' if cached else 'computed'}, "
                  f"{variant}: layer {total * 1e3:.1f} µs")  # fmt: skip
    reduce = {r["d_out"]: {} for r in rows if r["pass"] == "scale_reduce"}
    for r in rows:
        if r["pass"] == "scale_reduce":
            reduce[r["d_out"]][r["variant"]] = r["ms"]
    for variant in ("split rule", "rule off", "one chunk (before)"):
        total = sum(D_OUTS[d] * v.get(variant, v["split rule"]) for d, v in reduce.items())
        print(f"[llama_passes] scale_reduce, {variant}: layer {total * 1e3:.1f} µs")
    write_csv(pathlib.Path(args.out) / "llama_passes.csv", rows)
    print(f"[llama_passes] all within {MAX_REL_ERR}: {all(r['ok'] for r in rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
