"""Where the time of one JAX ScaLoRA merge step goes, part by part (issue 12).

Synthetic layers of Llama-8B shapes (Flax layout: bf16 kernel [d_in, d_out], f32 lora_a
[d_in, r] and lora_b [r, d_out], as ``bench_scalora_jax``'s ``nnx.LoRA`` model), seven
projections per decoder layer. Each part is jitted over every layer at once and timed as the
median wall time until ready (``measure.jax_time_ms``):

- ``system``: K, λ and the status of every layer (``scalora._system``);
- ``solve``: the batched solves of one rank, per ``config.SCALORA_EIGH_ON_GPU``;
- ``merge``: every layer's ``merge_scaled``, per ``config.SCALORA_MERGE_ROWS`` (0 in the CSV
  means one block: the whole product);
- ``update``: ``scalora_update`` whole, with optax AdamW state (not donated, so each call
  also copies the kernels: compare rows with each other, not with the model step).

    python3 -m benchmarks.bench_scalora_parts_jax --ranks 8 64
    python3 -m benchmarks.bench_scalora_parts_jax --tiny      # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib

from benchmarks.measure import jax_time_ms, write_csv

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False

FIELDS = ["part", "rank", "merge_rows", "eigh", "layers", "ms"]
SHAPES = {  # d_in, d_out of the seven projections (Llama-8B)
    "q_proj": (4096, 4096),
    "k_proj": (4096, 1024),
    "v_proj": (4096, 1024),
    "o_proj": (4096, 4096),
    "gate_proj": (4096, 14336),
    "up_proj": (4096, 14336),
    "down_proj": (14336, 4096),
}
WHOLE = 1 << 30  # SCALORA_MERGE_ROWS large enough for one block


def layers(rank: int, n_layers: int, tiny: bool):
    """(adapters, base, grads) over ``n_layers`` decoder layers; tiny divides shapes by 64."""
    import jax
    import jax.numpy as jnp

    adapters, base, grads = {}, {}, {}
    key = jax.random.key(0)
    for i in range(n_layers):
        for name, (d_in, d_out) in SHAPES.items():
            if tiny:
                d_in, d_out = d_in // 64, d_out // 64
            key, *ks = jax.random.split(key, 6)
            k = f"{i}/{name}"
            adapters[k] = {
                "lora_a": jax.random.normal(ks[0], (d_in, rank), jnp.float32) * 0.02,
                "lora_b": jax.random.normal(ks[1], (rank, d_out), jnp.float32) * 0.01,
            }
            base[k] = (jax.random.normal(ks[2], (d_in, d_out), jnp.float32) * 0.02).astype(
                jnp.bfloat16
            )
            grads[k] = {
                "lora_a": jax.random.normal(ks[3], (d_in, rank), jnp.float32) * 1e-3,
                "lora_b": jax.random.normal(ks[4], (rank, d_out), jnp.float32) * 1e-3,
            }
    return adapters, base, grads


@contextlib.contextmanager
def _config(**values):
    from dora_jax import config

    old = {k: getattr(config, k) for k in values}
    try:
        for k, v in values.items():
            setattr(config, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(config, k, v)


def measure(rank: int, n_layers: int, tiny: bool, iters: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import optax

    from dora_jax import scalora as sc

    adapters, base, grads = layers(rank, n_layers, tiny)
    keys = list(adapters)
    rows = []

    def row(part, ms, merge_rows="", eigh=""):
        rows.append(dict(part=part, rank=rank, merge_rows=merge_rows, eigh=eigh,
                         layers=len(keys), ms=round(ms, 3)))  # fmt: skip
        print(f"[scalora_parts] r={rank} {part:7s} rows={merge_rows!s:6s} eigh={eigh:4s} "
              f"{ms:9.3f} ms", flush=True)  # fmt: skip

    def systems(adapters, grads):
        out = [sc._system(adapters[k]["lora_a"], adapters[k]["lora_b"], grads[k]["lora_a"],
                          grads[k]["lora_b"], 1.0) for k in keys]  # fmt: skip
        return tuple(jnp.stack([o[i] for o in out]) for i in range(3))

    def timed(fn, *args):
        return jax_time_ms(lambda: fn(*args), iters=iters)

    sys_fn = jax.jit(systems)
    row("system", timed(sys_fn, adapters, grads))
    K, lam, status = sys_fn(adapters, grads)
    eL = jnp.ones((len(keys),), K.dtype)

    for eigh in ("qr", "jax"):
        with _config(SCALORA_EIGH_ON_GPU=eigh):
            solve = jax.jit(jax.vmap(lambda *xs: sc._solve(*xs, sc.default_tol(K.dtype))))
            row("solve", timed(solve, K, lam, eL, status), eigh=eigh)
    alpha = jnp.full((len(keys), rank), 0.9, jnp.float32)
    beta = jnp.full((len(keys), rank), 1.1, jnp.float32)

    opt_state = optax.adamw(1e-5).init(adapters)
    for merge_rows in (1024, WHOLE):
        label = 0 if merge_rows == WHOLE else merge_rows
        with _config(SCALORA_MERGE_ROWS=merge_rows):

            def merges(base, adapters, alpha, beta):
                return [
                    sc.merge_scaled(base[k], ad["lora_a"], ad["lora_b"], alpha[i], beta[i], 1.0)
                    for i, (k, ad) in enumerate(adapters.items())
                ]

            def update(a, b, o, g):
                return sc.scalora_update(a, b, o, g, lr_times_L=1.0, scaling=1.0)

            row("merge", timed(jax.jit(merges), base, adapters, alpha, beta), merge_rows=label)
            ms = timed(jax.jit(update), adapters, base, opt_state, grads)
            row("update", ms, merge_rows=label, eigh="qr")
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = p.parse_args(argv)
    rows = []
    for r in args.ranks:
        rows += measure(r, args.layers, args.tiny, args.iters)
    write_csv(args.out / "scalora_parts_jax.csv", rows, FIELDS)
    return rows


if __name__ == "__main__":
    main()
