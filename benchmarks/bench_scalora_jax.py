"""ScaLoRA's GPU cost on Llama-8B shapes (issue 12, item 6), JAX backend.

Model: ``bench_model_jax``'s nnx Llama twin (bf16 base, vocab 128256), with flax's own
``nnx.LoRA`` over every projection (fp32 adapter params, lora_b drawn small instead of flax's
zeros so the column branch can occur), batch 1 × 2048. A step is what a user of
``dora_jax.scalora_step`` runs: a jitted ``nnx.grad`` of the LM loss w.r.t. the adapters,
``scalora_step`` (every step, or ScaLoRA-I with I = 10, 100, given the loop's step counter
as a Python int so that non-merge steps return on the host), a jitted ``optimizer.update``
(optax AdamW). Variants and statistics as in ``bench_scalora_torch``: the mean step time after
3 warm-up steps over max(20, largest I of the variants run) steps, the same count for every
variant of a rank (ScaLoRA-I's cost is amortised; under JAX's asynchronous dispatch a longer
loop may run further ahead of the GPU and hold more steps' buffers, so peaks are compared
over equal loops), and the device's peak memory (``memory_stats``; not reported on CPU).
Ratios against ``lora`` of the same rank.
JAX's GPU client cannot reset its peak, so a process's peak covers every variant it ran: without
``--isolate`` (one process per variant) such peaks are not reported (run 15's in-process peaks
were printed and were not comparable).

    python3 -m benchmarks.bench_scalora_jax --ranks 8 64 --layers 8 --isolate
    python3 -m benchmarks.bench_scalora_jax --tiny      # a CPU smoke run of the same code

``--eigh jax`` runs the systems' eigensolver as JAX picks it on GPUs (batched Jacobi for
2r ≤ 32) instead of ``dora_jax.config.SCALORA_EIGH_ON_GPU``'s default "qr" (both written to
the log; compare two invocations). ``--sync-each-step`` waits for every step's adapters
before the next step is dispatched: the loop cannot run ahead of the GPU, so its peak holds
one step's buffers (the test of whether run-ahead explains run 26's I = 100 peak); its step
times include the waits. ``--trace-peak`` waits for every step too (warm-up included) and
records the device's peak after it; each row then lists the steps at which the peak rose
(step 0 is the first warm-up step; ScaLoRA-I merges where step % I == 0), which says whether a
variant's higher peak is set by a merge or by a later LoRA step (allocator history).
``--phases`` waits after each phase of a step (gradient, ScaLoRA, update) and reports their
medians; ``--one-jit`` runs each variant's whole step as one ``nnx.jit`` (LoRA's too), which
removes the per-call host work of the three separately dispatched phases (``nnx.jit``'s and
``scalora_step``'s walks of the model), donates the model and the optimizer, and lets the host
pick ScaLoRA-I's merge steps through a static flag (two compiled programs) unless
``--device-counter`` asks for the optimizer's counter and a ``lax.cond``; ``--merge-rows`` sets
``dora_jax.config.SCALORA_MERGE_ROWS``; ``--steps`` the number of timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from benchmarks import bench_model_jax as bm
from benchmarks.bench_scalora_torch import VARIANTS, summary_rows, variant_rows
from benchmarks.measure import write_csv

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

FIELDS = ["backend", "variant", "rank", "interval", "steps", "sync_each_step", "one_jit",
          "device_counter",
          "step_mean_ms", "peak_gib", "time_ratio", "peak_ratio", "peak_rises",
          "phases_ms"]  # fmt: skip
GIB = 2.0**30
LR, LR_TIMES_L = 1e-5, 1.0  # the cost does not depend on L·η (both branches are computed)


def _model(rank: int, n_layers: int, tiny: bool):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = bm.build_base(n_layers, tiny=tiny)

    def lora(linear, *, rank, alpha, dtype, rngs):
        del alpha  # nnx.LoRA has no scaling (s = 1)
        d_in, d_out = linear.kernel.get_value().shape
        layer = nnx.LoRA(d_in, rank, d_out, base_module=linear, param_dtype=dtype, rngs=rngs)
        b = jax.random.normal(rngs.params(), (rank, d_out), jnp.float32) * 0.01
        layer.lora_b.set_value(b.astype(dtype))
        return layer

    bm._replace(model, lora, rank=rank, alpha=2 * rank, dtype=jnp.float32, rngs=nnx.Rngs(1))
    return model


def measure(
    rank: int,
    interval: int,
    *,
    steps: int | None = None,
    layers: int = 8,
    tiny: bool = False,
    own_process: bool = False,
    sync_each_step: bool = False,
    trace_peak: bool = False,
    phases: bool = False,
    one_jit: bool = False,
    device_counter: bool = False,
) -> dict:
    """One variant over ``steps`` timed steps (default max(20, interval)). ``own_process``:
    nothing else ran in this process, so its device peak is this variant's even where the
    peak cannot be reset; otherwise such a peak is not reported (None). ``sync_each_step``:
    wait for each step's adapters before dispatching the next; ``trace_peak``: the same, and
    the steps at which the device peak rose (module docstring); ``phases``: wait after each
    phase of a step (gradient, ScaLoRA, optimizer update) and report each phase's median;
    ``one_jit``: the whole step (gradient, ``scalora_step``, update) is one ``nnx.jit``, for
    LoRA too (no host work per phase; ``phases`` ignored), ScaLoRA-I's merge steps chosen by
    the host through a static flag, or with ``device_counter`` by the optimizer's counter on
    the device (``lax.cond``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from dora_jax.scalora import scalora_step

    model = _model(rank, layers, tiny)
    vocab, seq = bm.vocab_and_seq(tiny)
    ids = jax.random.randint(jax.random.key(0), (1, seq), 0, vocab, dtype=jnp.int32)
    opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.LoRAParam)
    diff = nnx.DiffState(0, nnx.LoRAParam)

    def loss(model, ids):
        logits = model(ids)[:, :-1].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    grad = nnx.jit(nnx.grad(loss, argnums=diff))

    @nnx.jit
    def update(model, opt, grads):
        opt.update(model, grads)

    count = [0]  # the training loop's step counter (a Python int: see scalora_step)
    spent = {"grad": [], "scalora": [], "update": []}

    def phase(name, t0, outputs):
        """With ``phases``: wait for ``outputs()`` and record the phase's time (the callable
        keeps the wait's host work, e.g. ``nnx.state``, out of steps timed without it)."""
        if phases:
            jax.block_until_ready(outputs())
            spent[name].append((time.perf_counter() - t0) * 1e3)
        return time.perf_counter()

    # As the README shows: the model and optimizer donated (kernels merged in place), and
    # ScaLoRA-I decided by the host (a static flag: a merge program and LoRA's own program)
    # unless ``device_counter`` asks for the optimizer's counter and a lax.cond.
    @nnx.jit(donate_argnums=(0, 1), static_argnames="merge")
    def whole(model, opt, ids, merge):
        grads = nnx.grad(loss, argnums=diff)(model, ids)
        if device_counter and interval:
            grads, _ = scalora_step(model, opt, grads, lr_times_L=LR_TIMES_L, interval=interval)
        elif merge:
            grads, _ = scalora_step(model, opt, grads, lr_times_L=LR_TIMES_L)
        opt.update(model, grads)

    def step():
        if one_jit:
            whole(model, opt, ids, merge=bool(interval) and count[0] % interval == 0)
            count[0] += 1
            return
        t = time.perf_counter()
        grads = grad(model, ids)
        t = phase("grad", t, lambda: grads)
        if interval:
            grads, _ = scalora_step(
                model, opt, grads, lr_times_L=LR_TIMES_L, step=count[0], interval=interval
            )
            t = phase("scalora", t, lambda: (grads, nnx.state(model)))
        update(model, opt, grads)
        phase("update", t, lambda: nnx.state(model, nnx.LoRAParam))
        count[0] += 1

    def ready():
        jax.block_until_ready(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))

    device = jax.devices()[0]
    rises, last = [], [0]

    def traced():
        if not trace_peak:
            return
        ready()
        peak = (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
        if peak > last[0]:
            rises.append((count[0] - 1, round(peak / GIB, 3)))
            last[0] = peak

    for _ in range(3):
        step()
        traced()
    ready()
    for times in spent.values():
        times.clear()
    stats = device.memory_stats() or {}
    resettable = hasattr(device, "reset_memory_stats")
    if "peak_bytes_in_use" in stats and resettable:
        device.reset_memory_stats()
    steps = max(20, interval) if steps is None else steps
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
        if sync_each_step:
            ready()
        traced()
    ready()
    ms = (time.perf_counter() - t0) / steps * 1e3
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
    if not (resettable or own_process):
        peak = None  # the process-wide peak would include the variants run before this one
    return {"backend": jax.default_backend(), "rank": rank, "interval": interval,
            "steps": steps, "sync_each_step": sync_each_step, "one_jit": one_jit,
            "device_counter": device_counter,
            "step_mean_ms": round(ms, 2),
            "peak_gib": None if peak is None else round(peak / GIB, 3),
            "peak_rises": " ".join(f"{i}:{g}" for i, g in rises) or None,
            "phases_ms": " ".join(f"{k}:{statistics.median(v):.2f}" for k, v in spent.items()
                                  if v) or None}  # fmt: skip


def _isolated(
    rank: int,
    interval: int,
    *,
    steps: int,
    layers: int,
    tiny: bool,
    sync_each_step: bool,
    trace_peak: bool,
    phases: bool,
    one_jit: bool,
    device_counter: bool,
) -> dict:
    """``measure`` in a fresh Python process (its own device peak)."""
    from dora_jax import config as dora_config

    args = [sys.executable, "-m", "benchmarks.bench_scalora_jax", "--one", str(rank),
            str(interval), str(steps), "--layers", str(layers), "--eigh",
            dora_config.SCALORA_EIGH_ON_GPU] + (["--tiny"] if tiny else []) + (
            ["--sync-each-step"] if sync_each_step else []) + (
            ["--trace-peak"] if trace_peak else []) + (["--phases"] if phases else []) + (
            ["--one-jit"] if one_jit else []) + (
            ["--device-counter"] if device_counter else []) + [
            "--merge-rows", str(dora_config.SCALORA_MERGE_ROWS)]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"variant r={rank} I={interval} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bench(out_dir, ranks, *, layers: int = 8, tiny: bool = False, isolate: bool = False,
           variants=tuple(VARIANTS), sync_each_step: bool = False,
           trace_peak: bool = False, phases: bool = False, steps: int | None = None,
           one_jit: bool = False, device_counter: bool = False):  # fmt: skip
    import jax

    rows, summary = [], []
    chosen = {n: i for n, i in VARIANTS.items() if n in variants or n == "lora"}  # LoRA: baseline
    steps = max(20, *chosen.values()) if steps is None else steps
    for rank in ranks:
        got = {}
        for name, interval in chosen.items():
            kw = dict(steps=steps, layers=layers, tiny=tiny, sync_each_step=sync_each_step,
                      trace_peak=trace_peak, phases=phases, one_jit=one_jit,
                      device_counter=device_counter)  # fmt: skip
            if isolate:
                got[name] = _isolated(rank, interval, **kw)
            else:
                got[name] = measure(rank, interval, **kw)
                jax.clear_caches()
        rows += variant_rows("scalora_jax", rank, got)
        summary += summary_rows("scalora_jax", rank, got)
    write_csv(pathlib.Path(out_dir) / "scalora_jax.csv", rows, FIELDS)
    return summary


def run(out_dir: pathlib.Path) -> list[dict]:
    """``benchmarks.run`` protocol: r = 8 and 64, 8 layers."""
    return _bench(out_dir, [8, 64])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU smoke run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench")
    ap.add_argument("--isolate", action="store_true", help="one process per variant")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--eigh", default="qr", choices=["qr", "jax"],
                    help="dora_jax.config.SCALORA_EIGH_ON_GPU for this run")  # fmt: skip
    ap.add_argument(
        "--sync-each-step",
        action="store_true",
        help="wait for each step before the next (no run-ahead)",
    )
    ap.add_argument(
        "--trace-peak",
        action="store_true",
        help="wait for each step and list the steps at which the peak rose",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="wait after each phase of a step and report the phases' medians (phases_ms)",
    )
    ap.add_argument("--one-jit", action="store_true",
                    help="the whole step (grad, scalora_step, update) in one nnx.jit")  # fmt: skip
    ap.add_argument("--device-counter", action="store_true",
                    help="with --one-jit: ScaLoRA-I decided on the device (lax.cond)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per variant (default max(20, largest I))")  # fmt: skip
    ap.add_argument("--merge-rows", type=int, default=None,
                    help="dora_jax.config.SCALORA_MERGE_ROWS for this run")  # fmt: skip
    ap.add_argument(
        "--one", type=int, nargs=3, metavar=("RANK", "INTERVAL", "STEPS"), help=argparse.SUPPRESS
    )  # a child of --isolate: print one JSON row
    args = ap.parse_args(argv)
    from dora_jax import config as dora_config

    dora_config.SCALORA_EIGH_ON_GPU = args.eigh
    if args.merge_rows is not None:
        dora_config.SCALORA_MERGE_ROWS = args.merge_rows
    print(f"[scalora_jax] eigensolver on GPUs: {args.eigh}, merge rows "
          f"{dora_config.SCALORA_MERGE_ROWS}", flush=True)  # fmt: skip
    if args.one:
        rank, interval, steps = args.one
        row = measure(rank, interval, steps=steps, layers=args.layers, tiny=args.tiny,
                      own_process=True, sync_each_step=args.sync_each_step,
                      trace_peak=args.trace_peak, phases=args.phases,
                      one_jit=args.one_jit, device_counter=args.device_counter)  # fmt: skip
        print(json.dumps(row))
        return 0
    summary = _bench(args.out, args.ranks, layers=args.layers, tiny=args.tiny,
                     isolate=args.isolate, variants=args.variants,
                     sync_each_step=args.sync_each_step, trace_peak=args.trace_peak,
                     phases=args.phases, steps=args.steps, one_jit=args.one_jit,
                     device_counter=args.device_counter)  # fmt: skip
    for row in summary:
        print(f"{row['metric']}: {row['value']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
