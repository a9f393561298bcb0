"""The JAX norm's pieces, timed on their own at the projection shapes of a Llama-8B layer.

Each piece is jitted as a ``lax.fori_loop`` of ``--calls`` calls whose inputs depend on the
previous call's result (a is nudged by 1e-30 of the last output), so XLA can neither hoist
the work out of the loop nor is the time per call the host's dispatch floor, which a Python
loop of jitted calls hits below ~50 µs (run 86). Pieces, for a bf16 kernel K [d_in, d_out],
a [d_in, r] and b [r, d_out] (bf16, the benches' adapter setting), ‖K‖² given:

  u             U = aᵀK, f32 out (the norm's one large GEMM);
  gram          G = aᵀa, one dot;
  gram_split    G as a batched dot over ``--gram-slices`` slices of d_in, summed: the same
                FLOPs in slices × (r/128)² output tiles instead of (r/128)² (run 89: no
                faster at r = 384, slower at r = 16; kept as the measured alternative);
  norm_f32_gram the whole norm with G·b as an f32 HIGHEST product (``NORM_GEMM_BF16X3`` off);
  norm          the whole norm as the library forms it (G·b as bf16x3 on GPUs).

    python3 -m benchmarks.bench_jax_parts --out benchmarks/results    # on the GPU
    python3 -m benchmarks.bench_jax_parts --tiny                     # CPU smoke

Prints µs per call and a per-layer sum over the seven projections (q, k, v, o, gate, up,
down); writes ``jax_parts.csv``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

from benchmarks.bench_model_jax import norm_gemm_bf16x3
from benchmarks.measure import write_csv

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False

#: (name, d_in, d_out) of one Llama-8B decoder layer's adapted projections.
PROJECTIONS = (
    ("q", 4096, 4096),
    ("k", 4096, 1024),
    ("v", 4096, 1024),
    ("o", 4096, 4096),
    ("gate", 4096, 14336),
    ("up", 4096, 14336),
    ("down", 14336, 4096),
)
TINY = (("q", 64, 64), ("down", 192, 64))
PIECES = ("u", "gram", "gram_split", "norm_f32_gram", "norm")
SCALING = 2.0


def gram_split(lora_a, slices: int):
    """G = aᵀa as ``slices`` batched products over equal slices of d_in, summed in f32
    (d_in zero-padded to a multiple of ``slices``: zero rows add nothing)."""
    import jax.numpy as jnp
    from jax import lax

    d_in, r = lora_a.shape
    rows = -(-d_in // slices)
    a = jnp.pad(lora_a, ((0, rows * slices - d_in), (0, 0))).reshape(slices, rows, r)
    dims = (((1,), (1,)), ((0,), (0,)))
    return lax.dot_general(a, a, dims, preferred_element_type=jnp.float32).sum(0)


def _piece(name: str, slices: int):
    """f(kernel, a, b, base_sq) -> an array, for piece ``name``. U and G are the library's own
    products (``norm.norm_gemms``; XLA drops the one a piece does not return)."""
    from dora_jax.norm import norm_gemms, norm_parts

    def norm(k, a, b, sq):
        return norm_parts(k, a, b, sq, scaling=SCALING, chunk_size=None)[0]

    return {
        "u": lambda k, a, b, sq: norm_gemms(k, a)[0],
        "gram": lambda k, a, b, sq: norm_gemms(k, a)[1],
        "gram_split": lambda k, a, b, sq: gram_split(a, slices),
        "norm_f32_gram": norm,
        "norm": norm,
    }[name]


def time_piece(fn, args, *, calls: int, reps: int) -> float:
    """Median µs per call of ``fn`` over ``reps`` runs of a jitted loop of ``calls`` calls."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    k, a, b, sq = args

    @jax.jit
    def loop(k, a, b, sq):
        def body(_, carry):
            out = fn(k, a + carry.astype(a.dtype), b, sq)
            return (1e-30 * jnp.ravel(out)[0]).astype(jnp.float32)

        return lax.fori_loop(0, calls, body, jnp.float32(0))

    jax.block_until_ready(loop(k, a, b, sq))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(k, a, b, sq))
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def run(*, tiny: bool, ranks, calls: int, reps: int, slices: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    rows = []
    for r in ranks:
        for proj, d_in, d_out in TINY if tiny else PROJECTIONS:
            keys = jax.random.split(jax.random.key(0), 3)
            k = (jax.random.normal(keys[0], (d_in, d_out)) * 0.02).astype(jnp.bfloat16)
            a = (jax.random.normal(keys[1], (d_in, r)) * 0.02).astype(jnp.bfloat16)
            b = (jax.random.normal(keys[2], (r, d_out)) * 0.02).astype(jnp.bfloat16)
            sq = jnp.sum(jnp.square(k.astype(jnp.float32)), axis=0)
            row = dict(proj=proj, d_in=d_in, d_out=d_out, r=r, backend=jax.default_backend())
            for piece in PIECES:
                with norm_gemm_bf16x3(piece != "norm_f32_gram"):
                    fn = _piece(piece, slices)
                    row[f"{piece}_us"] = time_piece(fn, (k, a, b, sq), calls=calls, reps=reps)
            rows.append(row)
            print(" ".join(f"{key}={v:.1f}" if isinstance(v, float) else f"{key}={v}"
                           for key, v in row.items()), flush=True)  # fmt: skip
    return rows


def layer_sums(rows: list[dict]) -> list[dict]:
    """Per rank, every piece summed over one layer's projections (µs)."""
    out = []
    for r in sorted({row["r"] for row in rows}):
        mine = [row for row in rows if row["r"] == r]
        out.append(
            dict(
                proj="layer",
                r=r,
                **{f"{p}_us": sum(row[f"{p}_us"] for row in mine) for p in PIECES},
            )
        )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 384])
    ap.add_argument("--calls", type=int, default=50, help="calls per jitted loop")
    ap.add_argument("--reps", type=int, default=7, help="timed loops per piece (median)")
    ap.add_argument("--gram-slices", type=int, default=8, help="slices of d_in for gram_split")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="directory for jax_parts.csv")
    args = ap.parse_args(argv)
    if args.gram_slices < 1:
        ap.error(f"--gram-slices must be >= 1; got {args.gram_slices}")
    rows = run(
        tiny=args.tiny, ranks=args.ranks, calls=args.calls, reps=args.reps, slices=args.gram_slices
    )
    sums = layer_sums(rows)
    for row in sums:
        print(
            " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        )
    if args.out is not None:
        write_csv(args.out / "jax_parts.csv", rows + sums)


if __name__ == "__main__":
    main()
