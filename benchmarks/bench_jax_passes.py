"""The backward's cotangent passes on their own: XLA's form against the Mosaic kernels.

Two passes over [T, N] (docs/design.md §4, §4.1), bf16:

  scale_reduce  one layer: g ⊙ dy and Σ_t dy ⊙ inner (``xla_ops.scale_reduce`` against
                ``mosaic.scale_reduce``); reads 2, writes 1 [T, N] array;
  swiglu        a SwiGLU pair: the activation's derivative, then both layers' scale-and-reduce
                (autodiff of silu(y_gate) · y_up and two ``xla_ops.scale_reduce`` against
                ``mosaic.swiglu_backward``); reads 3, writes 2 [T, N] arrays.

Each variant is jitted as a ``lax.fori_loop`` of ``--calls`` calls (``bench_jax_parts``'s
method, below the ~50 µs dispatch floor of a Python loop), and the loop carries its dependence
through **g** only: each call's g is nudged by 1e-30 of the previous call's outputs. Nudging a
[T, N] operand instead (as runs 123 and 127's probes did) costs the Mosaic rows one more read
and write of that operand, which XLA fuses into its own pass (benchmarks/NOTES.md, session 28).
GB/s counts the arrays each pass must read and write once.

    python3 -m benchmarks.bench_jax_passes --out benchmarks/results          # on the GPU
    python3 -m benchmarks.bench_jax_passes --tiles 64x128 256x32 128x64      # tile sweep
    python3 -m benchmarks.bench_jax_passes --tiles 256x32c64 256x128c64      # slabs of 64 rows
    python3 -m benchmarks.bench_jax_passes --tiny                            # CPU smoke

Writes ``jax_passes.csv``: one row per (pass, T, N, variant).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import statistics
import time

from benchmarks.measure import write_csv

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False

#: [T, N] of the passes in the 8-layer bench model at batch 1 and 4 × 2048 (k/v, q/o/down,
#: gate/up widths).
SHAPES = ((2048, 1024), (2048, 4096), (2048, 14336), (8192, 4096), (8192, 14336))
TINY_SHAPES = ((64, 128),)
PASSES = ("scale_reduce", "swiglu")
#: [T, N] arrays each pass reads plus writes (the floor's bytes).
ARRAYS = {"scale_reduce": 3, "swiglu": 5}
_TILE = re.compile(r"(\d+)x(\d+)(?:c(\d+))?")


def parse_tile(text: str) -> tuple[int, int, int | None]:
    """(tile_m, tile_n, chunk_m) from ``MxN`` or ``MxNcC`` (the arithmetic in C-row slabs,
    the config's ``*_chunk_m``; None if left out), e.g. ``64x128`` or ``256x32c64``."""
    m = _TILE.fullmatch(text)
    if m is None:
        raise ValueError(f"a tile must look like MxN or MxNcC (e.g. 256x32c64); got {text!r}")
    chunk = m.group(3)
    return int(m.group(1)), int(m.group(2)), None if chunk is None else int(chunk)


def tile_name(tile_m: int, tile_n: int, chunk_m: int | None) -> str:
    """``parse_tile``'s text for a tile."""
    return f"{tile_m}x{tile_n}" + ("" if chunk_m is None else f"c{chunk_m}")


def tile_config(pass_name: str, tile_m: int, tile_n: int, chunk_m: int | None):
    """The default MosaicConfig with ``pass_name``'s tile fields replaced."""
    from dora_jax.config import DEFAULT_MOSAIC

    fields = {"tile_m": tile_m, "tile_n": tile_n, "chunk_m": chunk_m}
    return dataclasses.replace(DEFAULT_MOSAIC, **{f"{pass_name}_{k}": v for k, v in fields.items()})


def operands(tokens: int, n: int, seed: int = 0):
    """(cotangent, inner_a, inner_b, g_a, g_b): bf16 [T, N] arrays and f32 [N] g's."""
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.key(seed), 5)
    arrays = [jax.random.normal(k[i], (tokens, n), jnp.bfloat16) for i in range(3)]
    gs = [1 + 0.1 * jax.random.normal(k[3 + i], (n,)) for i in range(2)]
    return (*arrays, *gs)


def xla_swiglu(d_act, inner_g, inner_u, g_g, g_u):
    """The unfused pair's pass as the layers run it without ``dora_jax.swiglu``: autodiff of
    silu(y_gate) · y_up in the activation dtype, then each layer's XLA scale-and-reduce."""
    import jax
    import jax.numpy as jnp

    from dora_jax import xla_ops

    dt = d_act.dtype
    yg = (g_g[None, :] * inner_g.astype(jnp.float32)).astype(dt)
    yu = (g_u[None, :] * inner_u.astype(jnp.float32)).astype(dt)
    _, pull = jax.vjp(lambda a, b: jax.nn.silu(a) * b, yg, yu)
    dyg, dyu = pull(d_act)
    (sg, cg), (su, cu) = (
        xla_ops.scale_reduce(dyg, inner_g, g_g),
        xla_ops.scale_reduce(dyu, inner_u, g_u),
    )
    return sg, su, cg, cu


def variants(pass_name: str, tiles, *, interpret: bool) -> dict:
    """name -> (f(cotangent, inner_a, inner_b, g_a, g_b) -> outputs, MosaicConfig or None) for
    one pass: "xla", and "mosaic_<tile>" per kernel tile (``tile_name``; the default config's
    first)."""
    import functools

    from dora_jax import mosaic, xla_ops
    from dora_jax.config import DEFAULT_MOSAIC

    if pass_name not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}; got {pass_name!r}")
    default = tuple(
        getattr(DEFAULT_MOSAIC, f"{pass_name}_{k}") for k in ("tile_m", "tile_n", "chunk_m")
    )
    if pass_name == "scale_reduce":
        out = {"xla": (lambda ct, ia, ib, ga, gb: xla_ops.scale_reduce(ct, ia, ga), None)}
    else:
        out = {"xla": (xla_swiglu, None)}
    for tile in dict.fromkeys([default, *tiles]):
        config = tile_config(pass_name, *tile)
        if pass_name == "scale_reduce":
            kernel = functools.partial(mosaic.scale_reduce, config=config, interpret=interpret)
            fn = lambda ct, ia, ib, ga, gb, k=kernel: k(ct, ia, ga)  # noqa: E731
        else:
            fn = functools.partial(mosaic.swiglu_backward, config=config, interpret=interpret)
        out[f"mosaic_{tile_name(*tile)}"] = (fn, config)
    return out


def supported(pass_name: str, config, tokens: int, n: int) -> bool:
    """Whether a variant with this kernel ``config`` (None: XLA, every shape) takes [tokens, n]."""
    import jax.numpy as jnp

    from dora_jax import mosaic

    if config is None:
        return True
    check = (
        mosaic.scale_reduce_supported if pass_name == "scale_reduce" else mosaic.swiglu_supported
    )
    return check(tokens, n, jnp.bfloat16, config)


def time_loop(fn, args, *, calls: int, reps: int) -> float:
    """Median µs per call of ``fn(*args)`` over ``reps`` runs of a jitted loop of ``calls``
    calls, each call's g's nudged by 1e-30 of the previous call's outputs (module doc)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    @jax.jit
    def loop(ct, ia, ib, ga, gb):
        def body(_, carry):
            outs = fn(ct, ia, ib, ga + carry, gb + carry)
            return 1e-30 * sum(jnp.ravel(o)[0].astype(jnp.float32) for o in outs)

        return lax.fori_loop(0, calls, body, jnp.float32(0))

    jax.block_until_ready(loop(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def run(*, tiny: bool, passes, tiles, calls: int, reps: int) -> list[dict]:
    import jax

    interpret = jax.default_backend() != "gpu"
    rows = []
    for tokens, n in TINY_SHAPES if tiny else SHAPES:
        args = operands(tokens, n)
        for pass_name in passes:
            gbytes = ARRAYS[pass_name] * tokens * n * 2 / 1e9
            for name, (fn, config) in variants(pass_name, tiles, interpret=interpret).items():
                if not supported(pass_name, config, tokens, n):
                    continue
                us = time_loop(fn, args, calls=calls, reps=reps)
                row = dict(pass_name=pass_name, tokens=tokens, n=n, variant=name, us=us,
                           gb_per_s=gbytes / us * 1e6, backend=jax.default_backend())  # fmt: skip
                rows.append(row)
                print(f"{pass_name} T={tokens} N={n} {name}: {us:.1f} us, "
                      f"{row['gb_per_s']:.0f} GB/s", flush=True)  # fmt: skip
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke, interpreted)")
    ap.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    ap.add_argument("--tiles", nargs="*", default=[], help="extra kernel tiles, MxN or MxNcC each")
    ap.add_argument("--calls", type=int, default=50, help="calls per jitted loop")
    ap.add_argument("--reps", type=int, default=7, help="timed loops per variant (median)")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="directory for the CSV")
    args = ap.parse_args(argv)
    try:
        tiles = [parse_tile(t) for t in args.tiles]
    except ValueError as e:
        ap.error(str(e))
    rows = run(tiny=args.tiny, passes=args.passes, tiles=tiles, calls=args.calls, reps=args.reps)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "jax_passes.csv", rows)
    return rows


if __name__ == "__main__":
    main()
