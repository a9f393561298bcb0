"""A DoRA layer's inference forward (a frozen norm) with the XLA compose against the Mosaic GPU
compose, in one process, to decide what ``impl="auto"`` runs there.

``AUTO_MOSAIC["compose"]`` is None because with the base product's barriers XLA's compose was
never slower in training (run 108: the forward saves residuals, and the backward reads them).
With a frozen norm there is no backward over the adapters and no norm in the call: the
forward is x·K, h = x·a, and y = g ⊙ (base + s·h·b) + bias, where the Mosaic kernel does the
h·b product and the compose in one pass (``mosaic.compose``). Run 138's sequential layer rows
had it 14% ahead at 4096², r = 384, 512 tokens; this times both in interleaved rounds
(``measure.jax_time_rounds``, calls back to back) over the bench model's projection shapes,
r = 16 and 384, at 512, 2048 and 8192 tokens.

    python3 -m benchmarks.bench_compose_impl_jax --out $OUT      # on the GPU
    python3 -m benchmarks.bench_compose_impl_jax --tiny          # CPU: interpreted, both agree

Writes ``compose_impl_jax.csv``: one row per (shape, impl), with the paired median ratio
mosaic / xla of its shape.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

from benchmarks import measure
from benchmarks.measure import jax_time_rounds, paired_ratio, write_csv

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False
IMPLS = ("xla", "mosaic")
#: (d_in, d_out) of the Llama-8B projections: q/o, k/v, gate/up, down.
PROJECTIONS = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))
TOKENS = (512, 2048, 8192)
RANKS = (16, 384)
TINY = ((128, 128),)
TINY_TOKENS = (64,)
SCALING = 2.0


def layer(d_in: int, d_out: int, r: int, tokens: int, seed: int = 0):
    """(x, kernel, a, b, m, norm): bf16 activations and kernel, f32 adapters, and the frozen
    norm of (kernel, a, b)."""
    import jax
    import jax.numpy as jnp

    from dora_jax.norm import factored_norm

    k = jax.random.split(jax.random.key(seed), 5)
    bf = jnp.bfloat16
    x = jax.random.normal(k[0], (tokens, d_in), bf)
    kernel = (jax.random.normal(k[1], (d_in, d_out)) / d_in**0.5).astype(bf)
    a = jax.random.normal(k[2], (d_in, r)) / d_in**0.5
    b = 0.1 * jax.random.normal(k[3], (r, d_out))
    m = 1.0 + 0.1 * jax.random.normal(k[4], (d_out,))
    norm = jax.jit(factored_norm, static_argnums=3)(kernel, a, b, SCALING)
    return x, kernel, a, b, m, norm


def forwards(args, *, interpret: bool | None = None) -> dict:
    """impl -> a jitted inference forward of the layer ``args`` (``layer``)."""
    import jax

    from dora_jax.functional import dora_dense

    x, kernel, a, b, m, norm = args

    def make(impl):
        f = jax.jit(
            lambda x: dora_dense(
                x, kernel, a, b, m, SCALING, impl=impl, norm=norm, interpret=interpret
            )
        )
        return lambda: f(x)

    return {impl: make(impl) for impl in IMPLS}


def run(*, tiny: bool, ranks, tokens, rounds: int, per_round: int) -> list[dict]:
    import jax
    import numpy as np

    rows = []
    shapes = TINY if tiny else PROJECTIONS
    interpret = True if tiny else None
    for r in ranks:
        for t in TINY_TOKENS if tiny else tokens:
            for d_in, d_out in shapes:
                args = layer(d_in, d_out, r, t)
                calls = forwards(args, interpret=interpret)
                ys = {impl: np.asarray(call(), np.float32) for impl, call in calls.items()}
                # the kernel rounds y once, XLA rounds the base product and then y: two bf16
                # ulps apart at most (run 140 saw two, at one element of 8.4M)
                np.testing.assert_allclose(ys["mosaic"], ys["xla"], rtol=2**-6, atol=2**-6)
                times = jax_time_rounds(calls, rounds=rounds, per_round=per_round,
                                        back_to_back=True)  # fmt: skip
                ratio = paired_ratio(times, "mosaic", "xla")
                name = f"{d_in}x{d_out}_r{r}_t{t}"
                for impl in IMPLS:
                    us = statistics.median(times[impl]) * 1e3
                    rows.append(dict(shape=name, impl=impl, us=us, mosaic_per_xla=ratio,
                                     backend=jax.default_backend()))  # fmt: skip
                print(f"compose_impl {name}: xla {rows[-2]['us']:.1f} us, mosaic "
                      f"{rows[-1]['us']:.1f} us, mosaic / xla {ratio:.3f}", flush=True)  # fmt: skip
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small layer, interpreted (CPU)")
    ap.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    measure.add_round_args(ap, rounds=8, per_round=20)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    rows = run(tiny=args.tiny, ranks=args.ranks, tokens=args.tokens, **measure.round_args(ap, args))
    if args.out is not None:
        write_csv(args.out / "compose_impl_jax.csv", rows)
    return rows


if __name__ == "__main__":
    main()
