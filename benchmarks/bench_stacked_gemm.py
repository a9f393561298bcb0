"""The stacked [W; a] lead: one GEMM where a DoRA layer makes two, in the forward and in the
backward. Does it pay at the bench model's shapes, on the device and on the host?

Per layer and step the fused tier makes two pairs of GEMMs that share an operand
(``ops.forward_core``, ``ops.backward_core``; a = A, b = B in the activation dtype):

  fwd  separate  base = x Wᵀ, h = x aᵀ                  x read twice, two launches
       stacked   P = x Fᵀ, F = [W; a] [d_out + r, d_in]  base = P[:, :d_out], h = P[:, d_out:]
  bwd  separate  t = dy_g b, dx = dy_g W, dx += s·t a    three launches, dx read and written again
       stacked   G = [dy_g | s·t] [T, d_out + r]:        two launches
                 G[:, d_out:] = s·dy_g b (beta = 0, into G's columns), dx = G F

What the stacked forms change around these GEMMs (the compose kernel reading base and h as
column views of P, the scale-and-reduce pass writing dy_g into G's first d_out columns) moves
the same bytes and is not timed. Building the lead needs W to live in F (benchmarks/NOTES.md,
session 32): this probe decides first whether that is worth doing.

Every (projection shape of Llama-8B, r, tokens), forms taking turns in rounds:
  - ``gpu_us``: one form's launches captured in a CUDA graph, replayed ``--per-round`` times
    back to back, CUDA events around them: device time per call;
  - ``host_us``: the form called ``--per-round`` times back to back without waiting (the
    queue stays shorter than CUDA's), perf_counter around the calls: host time per call, what
    a host-bound eager step pays.
Rows give both forms' medians and the paired ratio stacked / separate; the summary rows add
the savings up over one training step of the bench model (8 layers × 7 projections, fwd +
bwd) in ms, on the device and on the host.

    python3 -m benchmarks.bench_stacked_gemm --out $OUT          # on the GPU (~1 min)
    python3 -m benchmarks.bench_stacked_gemm --tiny              # CPU: the forms agree

Writes ``stacked_gemm.csv`` (one row per shape, r, tokens and pass) and
``stacked_gemm_step.csv`` (per r and tokens: the step's savings).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import torch

from benchmarks import measure
from benchmarks.measure import paired_ratio, write_csv

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False
#: (projection, d_out, d_in, per layer) of Llama-8B: projections of one shape timed once.
PROJECTIONS = (("q_o", 4096, 4096, 2), ("k_v", 1024, 4096, 2), ("gate_up", 14336, 4096, 2),
               ("down", 4096, 14336, 1))  # fmt: skip
LAYERS = 8
TINY_PROJECTIONS = (("q_o", 48, 32, 2), ("down", 32, 80, 1))
PASSES = ("fwd", "bwd")
FORMS = ("separate", "stacked")


class Operands:
    """One layer's tensors: x [T, d_in], W, a, b, the stacked F = [W; a], dy_g and G, whose
    first d_out columns hold dy_g as the scale-and-reduce pass would write it there."""

    def __init__(self, tokens, d_out, d_in, r, *, dtype, device, scaling=2.0, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)  # on the device: 10⁸-element draws

        def rand(*shape, std=1.0):
            return (std * torch.randn(*shape, generator=g, device=device)).to(dtype)

        self.d_out, self.scaling = d_out, scaling
        self.x = rand(tokens, d_in)
        self.weight = rand(d_out, d_in, std=d_in**-0.5)
        self.a = rand(r, d_in, std=d_in**-0.5)
        self.b = rand(d_out, r, std=0.1)
        self.F = torch.cat([self.weight, self.a])
        self.dyg = rand(tokens, d_out)
        self.G = torch.empty(tokens, d_out + r, device=device, dtype=dtype)
        self.G[:, :d_out] = self.dyg


def fwd_separate(o: Operands):
    """(base, h) as ``ops.forward_core`` forms them."""
    return torch.mm(o.x, o.weight.t()), torch.mm(o.x, o.a.t())


def fwd_stacked(o: Operands):
    """(base, h) as column views of one product x Fᵀ."""
    p = torch.mm(o.x, o.F.t())
    return p[:, : o.d_out], p[:, o.d_out :]


def bwd_separate(o: Operands):
    """(dx, s·t) as ``ops.backward_core`` forms them (``addmm_inplace``: beta = 1 over dx)."""
    t = torch.mm(o.dyg, o.b)
    dx = torch.mm(o.dyg, o.weight).addmm_(t, o.a, alpha=o.scaling)
    return dx, o.scaling * t


def bwd_stacked(o: Operands):
    """(dx, s·t): s·t written into G's last r columns (beta = 0), then dx = G F."""
    d = o.d_out
    st = o.G[:, d:].addmm_(o.G[:, :d], o.b, beta=0.0, alpha=o.scaling)
    return torch.mm(o.G, o.F), st


CALLS = {("fwd", "separate"): fwd_separate, ("fwd", "stacked"): fwd_stacked,
         ("bwd", "separate"): bwd_separate, ("bwd", "stacked"): bwd_stacked}  # fmt: skip


def max_differences(o: Operands) -> dict[str, float]:
    """Per pass, the largest |stacked − separate| over its outputs."""
    out = {}
    for name in PASSES:
        pairs = zip(CALLS[name, "separate"](o), CALLS[name, "stacked"](o), strict=True)
        out[name] = max(float((u.float() - v.float()).abs().max()) for u, v in pairs)
    return out


def _graphed(fn, o: Operands):
    """fn(o) captured in a CUDA graph: the replay."""
    return measure.cuda_graph(lambda: fn(o))[0].replay


def run(*, tiny: bool, ranks, tokens_list, rounds: int, per_round: int):
    """(rows, step rows): per shape, r, tokens and pass, both forms' medians (µs) and their
    paired ratio; per r and tokens, the savings over one bench-model step (ms)."""
    cuda = torch.cuda.is_available() and not tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    timings = ("gpu", "host") if cuda else ("host",)
    rows, step_rows = [], []
    for rank in ranks:
        for tokens in tokens_list:
            saved = {timing: 0.0 for timing in timings}
            for proj, d_out, d_in, per_layer in TINY_PROJECTIONS if tiny else PROJECTIONS:
                o = Operands(tokens, d_out, d_in, rank, dtype=dtype, device=device)
                diff = max_differences(o)
                for name in PASSES:
                    row = {
                        "proj": proj,
                        "d_out": d_out,
                        "d_in": d_in,
                        "r": rank,
                        "tokens": tokens,
                        "pass": name,
                        "max_abs_diff": diff[name],
                        "dtype": str(dtype).removeprefix("torch."),
                    }
                    for timing in timings:
                        calls = {}
                        for form in FORMS:
                            fn = CALLS[name, form]
                            calls[form] = _graphed(fn, o) if timing == "gpu" else (
                                lambda fn=fn, o=o: fn(o))  # fmt: skip
                        times = measure.torch_time_rounds(calls, rounds=rounds, per_round=per_round,
                                                    timing=timing)  # fmt: skip
                        sep = statistics.median(times["separate"])
                        stk = statistics.median(times["stacked"])
                        row[f"{timing}_separate_us"] = sep
                        row[f"{timing}_stacked_us"] = stk
                        row[f"{timing}_ratio"] = paired_ratio(times, "stacked", "separate")
                        saved[timing] += (sep - stk) * per_layer * LAYERS * 1e-3
                    rows.append(row)
                    print("stacked_gemm " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()),
                          flush=True)  # fmt: skip
                del o
            step = dict(r=rank, tokens=tokens, layers=LAYERS)
            step |= {f"{timing}_saved_ms_per_step": ms for timing, ms in saved.items()}
            step_rows.append(step)
            print("stacked_gemm step " + ", ".join(f"{k}={_fmt(v)}" for k, v in step.items()),
                  flush=True)  # fmt: skip
    return rows, step_rows


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes in fp32 (CPU)")
    ap.add_argument("--ranks", type=measure.positive_int, nargs="+", default=[16, 384])
    ap.add_argument("--tokens", type=measure.positive_int, nargs="+", default=[2048, 8192])
    measure.add_round_args(ap, rounds=8, per_round=20)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    rows, step_rows = run(tiny=args.tiny, ranks=args.ranks, tokens_list=args.tokens,
                          **measure.round_args(ap, args))  # fmt: skip
    if args.out is not None:
        write_csv(args.out / "stacked_gemm.csv", rows)
        write_csv(args.out / "stacked_gemm_step.csv", step_rows)
    return rows, step_rows


if __name__ == "__main__":
    main()
