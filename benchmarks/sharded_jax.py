"""The Flax training step on a device mesh (issue 13, item 5): ours vs jnp LoRA, same mesh.

    python3 -m benchmarks.sharded_jax --mesh 2 1 --ranks 16 384     # 2 GPUs, data parallel
    python3 -m benchmarks.sharded_jax --mesh 1 2 --ranks 16 384     # 2 GPUs, tensor parallel
    python3 -m benchmarks.sharded_jax --mesh 1 1 --ranks 16 384     # the 1-GPU point
    python3 -m benchmarks.sharded_jax --tiny --mesh 2 2             # CPU smoke (4 host devices)

Model: ``bench_model_jax``'s nnx Llama twin (bf16 base, ``--layers`` of 32, default 8), batch
``--batch`` × 2048 per data shard. The kernels are annotated with Megatron's plan
(``dora_jax.sharding.LLAMA_TP_RULES``) and the model is placed on a ("data", "model") mesh;
batches are split over "data". Providers: ``jnp_lora`` (plain jnp LoRA layers over the same
kernels, bf16 adapters) and ``ours`` (``dora_jax.inject``, bf16 adapter params; the adapters
follow their kernels' sharding). A step is one ``nnx.jit`` of forward, backward and optax
AdamW on the adapters. Reported: the median step time of 10 steps after 3 warm-ups, tokens
per second, and the largest per-device peak memory (``memory_stats``; not on CPU).
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv and "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import pathlib
import statistics
import time

from benchmarks import bench_model_jax as bm
from benchmarks.measure import write_csv

PROVIDERS = ("jnp_lora", "ours")
FIELDS = ["backend", "devices", "mesh", "provider", "rank", "layers", "batch_per_shard", "seq",
          "step_ms", "tokens_per_s", "peak_gib_per_device", "error"]  # fmt: skip
GIB = 2.0**30


def _model(provider: str, rank: int, layers: int, tiny: bool):
    import jax.numpy as jnp
    from flax import nnx

    import dora_jax
    from dora_jax.sharding import LLAMA_TP_RULES, annotate

    model = bm.build_base(layers, tiny=tiny)
    annotate(model, LLAMA_TP_RULES)
    rngs = nnx.Rngs(1)
    if provider == "jnp_lora":
        lora = bm._baseline_layer("lora")
        bm._replace(model, lora, rank=rank, alpha=2 * rank, dtype=jnp.bfloat16, rngs=rngs)
    else:
        dora_jax.inject(model, target_modules=list(bm.TARGET_NAMES), r=rank,
                        lora_alpha=2 * rank, rngs=rngs, adapter_dtype=jnp.bfloat16)  # fmt: skip
    return model, bm.vocab_and_seq(tiny)[0]


def measure(provider, rank, mesh, *, layers, batch, seq, tiny) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from dora_jax.sharding import named, place

    model, vocab = _model(provider, rank, layers, tiny)
    place(model, mesh)
    data = mesh.shape["data"]
    ids = jax.random.randint(jax.random.key(0), (batch * data, seq), 0, vocab, dtype=jnp.int32)
    ids = jax.device_put(ids, named(mesh, "data", None))
    opt = nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.LoRAParam)

    def loss_fn(model, ids):
        logits = model(ids[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    @nnx.jit
    def step(model, opt, ids):
        diff = nnx.DiffState(0, nnx.LoRAParam)
        loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model, ids)
        opt.update(model, grads)
        return loss

    times = []
    with jax.set_mesh(mesh):
        for i in range(13):
            t0 = time.perf_counter()
            jax.block_until_ready(step(model, opt, ids))
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in mesh.devices.flat]
    peak = None if None in peaks else round(max(peaks) / GIB, 3)
    return {"step_ms": round(ms, 2), "tokens_per_s": round(batch * data * seq / (ms / 1e3)),
            "peak_gib_per_device": peak}  # fmt: skip


def main(argv=None) -> int:
    import jax

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", type=int, nargs=2, default=[2, 1], metavar=("DATA", "MODEL"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 384])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2, help="sequences per data shard")
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--tiny", action="store_true", help="a small model on host CPU devices")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench")
    args = ap.parse_args(argv)

    n = args.mesh[0] * args.mesh[1]
    devices = jax.devices("cpu" if args.tiny else None)
    if len(devices) < n:
        raise SystemExit(f"--mesh {args.mesh} needs {n} devices; found {len(devices)}")
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh(tuple(args.mesh), ("data", "model"), axis_types=(auto, auto),
                         devices=devices[:n])  # fmt: skip

    seq = bm.vocab_and_seq(args.tiny)[1]
    layers = 2 if args.tiny else args.layers
    rows = []
    for rank in args.ranks:
        for provider in args.providers:
            mesh_name = "x".join(map(str, args.mesh))
            row = {"backend": devices[0].platform, "devices": n, "mesh": mesh_name,
                   "provider": provider, "rank": rank, "layers": layers,
                   "batch_per_shard": args.batch, "seq": seq, "error": ""}  # fmt: skip
            try:
                with jax.default_device(devices[0]):
                    row.update(measure(provider, rank, mesh, layers=layers, batch=args.batch,
                                       seq=seq, tiny=args.tiny))  # fmt: skip
            except Exception as e:  # one provider failing must not end the others
                row["error"] = f"{type(e).__name__}: {e}"
            jax.clear_caches()
            rows.append(row)
            print(f"[sharded_jax] {row}", flush=True)
    path = pathlib.Path(args.out) / f"sharded_jax_mesh{args.mesh[0]}x{args.mesh[1]}.csv"
    write_csv(path, rows, FIELDS)
    print(f"[sharded_jax] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
