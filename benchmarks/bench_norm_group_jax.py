"""The JAX norms of a whole model: layer by layer (as the layers compute them today) against
grouped by shape (the small products and the assembly batched over the layers that share a
shape), to size a grouped norm before building one (benchmarks/NOTES.md, session 29).

A training step recomputes every adapted layer's norm from its parameters. Per layer that is
one large product, U = aᵀK (it reads K: at the bytes floor), and a handful of small kernels
(G = aᵀa, G·b, the assembly, g = m / n) of ~1.7 µs each, run 131 counts ~450 of them per
8-layer step at r = 16. The norms depend on the parameters only and are detached, so they
could all be formed at once: U per layer still (it must read each K), then G, G·b, n and g
as one batched product or fusion per group of layers of one shape (q and o, k and v, gate
and up, down in a Llama layer), a few dozen kernels instead of hundreds.

  per_layer  ``norm.norm_parts`` per layer, then g = m / n (the library's own path);
  grouped    U per layer (``norm.norm_gemms``' product), the rest batched per shape group:
             G by one batched dot, G·b and n by the layers' own assembly
             (``norm.assemble_parts``) under ``jax.vmap``.

Both are jitted as one program over ``--layers`` decoder layers of Llama-8B shapes (distinct
weights per layer), with every g as output; timed by ``measure.jax_time_ms`` (each program
has hundreds of kernels, far above the dispatch floor). On the CPU (``--tiny``) the two are
also checked to agree, which is what the tests run.

    python3 -m benchmarks.bench_norm_group_jax --ranks 16 384 --out $OUT   # on the GPU
    python3 -m benchmarks.bench_norm_group_jax --tiny                     # CPU check
"""

from __future__ import annotations

import argparse
import functools
import pathlib
from collections import defaultdict

from benchmarks.bench_jax_parts import PROJECTIONS, SCALING, TINY
from benchmarks.measure import write_csv

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False
VARIANTS = ("per_layer", "grouped")


def params(layers: int, rank: int, projections, seed: int = 0) -> list[dict]:
    """One dict of arrays per adapted layer: kernel K [d_in, d_out] and a, b in bf16, base_sq
    and m in f32; distinct arrays for every layer."""
    import jax
    import jax.numpy as jnp

    out = []
    key = jax.random.key(seed)
    for _ in range(layers):
        for _, d_in, d_out in projections:
            key, *k = jax.random.split(key, 4)
            kernel = (0.02 * jax.random.normal(k[0], (d_in, d_out))).astype(jnp.bfloat16)
            a = (0.02 * jax.random.normal(k[1], (d_in, rank))).astype(jnp.bfloat16)
            b = (0.02 * jax.random.normal(k[2], (rank, d_out))).astype(jnp.bfloat16)
            sq = jnp.sum(jnp.square(kernel.astype(jnp.float32)), axis=0)
            out.append(dict(kernel=kernel, a=a, b=b, base_sq=sq, m=jnp.sqrt(sq)))
    return out


def per_layer(ps: list[dict]) -> list:
    """g = m / n of every layer, each norm by ``norm.norm_parts`` (the layers' own path)."""
    from dora_jax.norm import norm_parts
    from dora_jax.xla_ops import magnitude_scale

    out = []
    for p in ps:
        n, _ = norm_parts(p["kernel"], p["a"], p["b"], p["base_sq"], scaling=SCALING,
                          chunk_size=None)  # fmt: skip
        out.append(magnitude_scale(p["m"], n, n.dtype))
    return out


def grouped(ps: list[dict]) -> list:
    """The same g's with U per layer and everything after it batched per shape group: G by
    one batched dot, the rest by the layers' own assembly (``norm.assemble_parts``) under
    ``jax.vmap``."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from dora_jax.norm import norm_gemms

    groups = defaultdict(list)
    for i, p in enumerate(ps):
        groups[p["kernel"].shape].append(i)
    out = [None] * len(ps)
    for members in groups.values():
        kernel_dtype = ps[members[0]]["kernel"].dtype

        def stacked(key, members=members):
            return jnp.stack([ps[i][key] for i in members])

        # U reads each K: one product per layer, as today (XLA drops the G beside it)
        u = jnp.stack([norm_gemms(ps[i]["kernel"], ps[i]["a"])[0] for i in members])
        a = stacked("a").astype(kernel_dtype)
        contract = (((1,), (1,)), ((0,), (0,)))  # aᵀa per layer: contract d_in, batch layers
        gram = lax.dot_general(a, a, contract, preferred_element_type=jnp.float32)
        assemble = functools.partial(_assemble, kernel_dtype=kernel_dtype)
        g = jax.vmap(assemble)(u, gram, stacked("b"), stacked("base_sq"), stacked("m"))
        for j, i in enumerate(members):
            out[i] = g[j]
    return out


def _assemble(u, gram, b, sq, m, *, kernel_dtype):
    """g = m / n of one layer from U, G, b and ‖K‖² by ``norm.assemble_parts``."""
    from dora_jax.norm import assemble_parts
    from dora_jax.xla_ops import magnitude_scale

    n, _ = assemble_parts(u, gram, b, sq, kernel_dtype=kernel_dtype, scaling=SCALING,
                          grad_parts=False)  # fmt: skip
    return magnitude_scale(m, n, n.dtype)


def run(*, tiny: bool, ranks, layers: int) -> list[dict]:
    import jax
    import numpy as np

    from benchmarks.measure import jax_time_ms

    rows = []
    for rank in ranks:
        ps = params(layers, rank, TINY if tiny else PROJECTIONS)
        fns = {"per_layer": jax.jit(per_layer), "grouped": jax.jit(grouped)}
        got = {name: jax.block_until_ready(fn(ps)) for name, fn in fns.items()}
        # The two compute the same f32 sums in other orders (batched GEMMs on the GPU: run
        # 136 differed by 2.8e-6); a layer wired to the wrong U or b would differ by O(1).
        for x, y in zip(got["per_layer"], got["grouped"], strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=0)
        for name, fn in fns.items():
            ms = jax_time_ms(lambda fn=fn, ps=ps: fn(ps), warmup=3, iters=20)
            rows.append(dict(variant=name, r=rank, layers=layers, adapted=len(ps), ms=ms,
                             backend=jax.default_backend()))  # fmt: skip
            print(f"norm_group r={rank} {layers} layers ({len(ps)} adapted) {name}: {ms:.3f} ms",
                  flush=True)  # fmt: skip
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU check)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 384])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers must be >= 1; got {args.layers}")
    rows = run(tiny=args.tiny, ranks=args.ranks, layers=args.layers)
    if args.out is not None:
        write_csv(args.out / "norm_group_jax.csv", rows)
    return rows


if __name__ == "__main__":
    main()
