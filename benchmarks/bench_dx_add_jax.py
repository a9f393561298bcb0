"""The down projection's input cotangent written five ways: can XLA fold its low-rank term
into cuBLAS (C = q·Aᵀ with beta = 1) instead of adding it in a pass of its own?

``vjp.layer_grads`` forms dx = dy_k·Kᵀ + q·aᵀ (kernel K [d_in, d_out], q = s·(dy_g·b)ᵀ
[T, r], a [d_in, r]): a cuBLAS GEMM, a small GEMM fusion, and an add. Where the next op is
an XLA fusion the add goes into it (jnp LoRA's SwiGLU backward takes it in); in ours the
down projection's dx feeds the SwiGLU pair's Mosaic kernel, so the add is a [T, 14336] pass
of its own, 8 per 8-layer step, 42 µs each (run 136, benchmarks/NOTES.md session 30).

  current    dot(dy, K) + dot(q, a), each bf16 (the library's form)
  f32_add    both dots accumulate to f32, added, rounded once
  swapped    dot(q, a) + dot(dy, K)
  convert    both bf16 dots converted to f32, added, rounded (a pattern the GEMM rewriter
             folds for legacy cuBLAS calls)
  concat     one dot over [dy | q] and [K | a] (K = d_out + r)
  gemm_only  dot(dy, K) alone: what the add and the small GEMM cost over it

Each form is compiled, its cuBLAS calls' beta read from the optimized HLO (``betas``: "1"
would mean the add went into the GEMM), and the forms are timed in interleaved rounds
(``measure.jax_time_rounds``, calls back to back), each against ``current``.

    python3 -m benchmarks.bench_dx_add_jax --out $OUT     # on the GPU
    python3 -m benchmarks.bench_dx_add_jax --tiny          # CPU: the forms agree

Writes ``dx_add_jax.csv``: one row per (r, form).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics

from benchmarks import measure
from benchmarks.measure import jax_time_rounds, paired_ratio, write_csv

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False
#: [T, d_out, d_in] of the bench model's down projection at batch 1 (and a CPU size).
SHAPE = (2048, 4096, 14336)
TINY_SHAPE = (64, 128, 256)
_CONTRACT_1 = (((1,), (1,)), ((), ()))
_BETA = re.compile(r'"beta":([0-9.eE+-]+)')


def _forms():
    import jax.numpy as jnp
    from jax import lax

    f32, dot = jnp.float32, lax.dot_general

    def current(dy, k, q, a):
        return dot(dy, k, _CONTRACT_1) + dot(q, a, _CONTRACT_1)

    def f32_add(dy, k, q, a):
        both = dot(dy, k, _CONTRACT_1, preferred_element_type=f32) + dot(
            q, a, _CONTRACT_1, preferred_element_type=f32
        )
        return both.astype(dy.dtype)

    def swapped(dy, k, q, a):
        return dot(q, a, _CONTRACT_1) + dot(dy, k, _CONTRACT_1)

    def convert(dy, k, q, a):
        both = dot(dy, k, _CONTRACT_1).astype(f32) + dot(q, a, _CONTRACT_1).astype(f32)
        return both.astype(dy.dtype)

    def concat(dy, k, q, a):
        return dot(jnp.concatenate([dy, q], 1), jnp.concatenate([k, a], 1), _CONTRACT_1)

    def gemm_only(dy, k, q, a):
        return dot(dy, k, _CONTRACT_1)

    return dict(current=current, f32_add=f32_add, swapped=swapped, convert=convert,
                concat=concat, gemm_only=gemm_only)  # fmt: skip


FORMS = tuple(_forms())


def betas(hlo_text: str) -> list[str]:
    """The beta of every cuBLAS call in an optimized HLO module's text, in order."""
    return _BETA.findall(hlo_text)


def operands(tokens: int, d_out: int, d_in: int, r: int, seed: int = 0):
    """(dy [T, d_out], K [d_in, d_out], q [T, r], a [d_in, r]) in bf16."""
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.key(seed), 4)
    bf = jnp.bfloat16
    return (
        jax.random.normal(k[0], (tokens, d_out), bf),
        (0.02 * jax.random.normal(k[1], (d_in, d_out))).astype(bf),
        jax.random.normal(k[2], (tokens, r), bf),
        (0.02 * jax.random.normal(k[3], (d_in, r))).astype(bf),
    )


def run(*, tiny: bool, ranks, rounds: int, per_round: int) -> list[dict]:
    import jax

    rows = []
    for rank in ranks:
        args = operands(*(TINY_SHAPE if tiny else SHAPE), rank)
        calls, found = {}, {}
        for name, fn in _forms().items():
            jitted = jax.jit(fn)
            found[name] = betas(jitted.lower(*args).compile().as_text())
            calls[name] = lambda jitted=jitted, args=args: jitted(*args)
        times = jax_time_rounds(calls, rounds=rounds, per_round=per_round, back_to_back=True)
        for name in calls:
            us = statistics.median(times[name]) * 1e3
            ratio = paired_ratio(times, name, "current")
            beta = " ".join(found[name])
            rows.append(dict(r=rank, form=name, us=us, per_current=ratio, betas=beta,
                             backend=jax.default_backend()))  # fmt: skip
            print(f"dx_add r={rank} {name}: {us:.1f} us, / current {ratio:.3f}, cuBLAS beta "
                  f"{found[name] or '-'}", flush=True)  # fmt: skip
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 384])
    measure.add_round_args(ap, rounds=6, per_round=50)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    rows = run(tiny=args.tiny, ranks=args.ranks, **measure.round_args(ap, args))
    if args.out is not None:
        write_csv(args.out / "dx_add_jax.csv", rows)
    return rows


if __name__ == "__main__":
    main()
