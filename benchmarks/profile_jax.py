"""Where a JAX training step spends GPU time, kernel by kernel: the profile Nsight Compute cannot
take of JAX programs on these machines (runs 63-64).

The bench model of ``bench_model_jax`` (the nnx Llama twin, Llama-8B shapes, ``--layers``
decoder layers, batch 1 × seq 2048, bf16) gets each provider's adapters; its jitted training
step (value-and-grad of the LM loss, optax AdamW, ``bench_model_jax.train_step``) runs a few
warm-up steps, then ``--steps`` steps under ``jax.profiler.trace``. The trace's device
events (CUPTI, one per kernel, each tagged with the HLO op that launched it) are summed per
HLO op and divided by the step count, and every op is labelled with its opcode, fusion kind
and result shape from the step's optimized HLO (``compiled.as_text()``), which is written
next to the CSV. XLA's command buffers (CUDA graphs) are switched off for this process, so
each kernel is an event of its own; the step's wall time then carries launch gaps that a
graphed step hides, and only the device time per op is the comparable number.

    python3 -m benchmarks.profile_jax --ranks 16 --providers jnp_lora ours_bf16 \\
        --out benchmarks/results                                # on the GPU
    python3 -m benchmarks.profile_jax --tiny --steps 2           # CPU smoke (host thunks)

``--programs grad train`` profiles the value-and-grad alone beside the training step (each
from its own compile), to see what the optimizer's program adds: the report lists every
program's difference against the first one of its rank.

Each op also gets the device's idle time just before its kernels (``idle_before``): where the
GPU waited for the host, which a step's device time alone cannot show; and the dora_jax part
it belongs to (``scope``: the norm, the compose, the backward's cotangent pass or its
gradients, from the name scopes ``dora_jax.vjp`` puts into every instruction's op_name), so
the report can sum a step's device time and kernels per part.

Writes ``profile_jax.csv`` (provider, program, rank, op, opcode, kind, shape, scope, kernels,
µs and idle µs per step) and ``profile_jax_<provider>_r<rank>[_grad].hlo.txt``; prints per
provider the device time per step, its top ops and parts, and per (opcode, kind) what each
provider spends beyond the first one.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import tempfile
from collections import defaultdict

from benchmarks.measure import jax_time_ms, write_csv

NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
# `%name = shape opcode(...)`, with `kind=kX` on fusions and the target on custom calls
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\(")
_KIND = re.compile(r"kind=(k\w+)")
# the first dora_jax name scope in an instruction's op_name (``dora_jax.vjp.*_SCOPE``), which
# JAX writes as a path component or inside its transforms: ".../jvp(dora_norm)/dot_general"
_SCOPE = re.compile(r'op_name="[^"]*?[/(](dora_[a-z_]+)[)/]')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def hlo_op_table(hlo_text: str) -> dict[str, dict]:
    """op name -> {opcode, kind, shape, scope} for every instruction of an HLO module's text.
    ``kind`` is a fusion's kind (kLoop, kInput, kOutput, kCustom) or a custom call's target;
    ``scope`` the dora_jax part it came from (``dora_norm``, ``dora_compose``,
    ``dora_scale_reduce``, ``dora_grads``: ``dora_jax.vjp``'s name scopes, which XLA keeps
    in each instruction's op_name), or "" for the rest of the program."""
    table = {}
    for line in hlo_text.splitlines():
        m = _HLO_OP.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        kind = _KIND.search(line) or _TARGET.search(line)
        scope = _SCOPE.search(line)
        table[name] = dict(
            opcode=opcode,
            kind=kind.group(1) if kind else "",
            shape=shape,
            scope=scope.group(1) if scope else "",
        )
    return table


def device_op_times(profile, *, module: str | None, device_prefix: str = "/device:") -> dict:
    """HLO op name -> (events, total ns) over the planes of a ``jax.profiler.ProfileData``
    whose name starts with ``device_prefix``. Events tagged ``hlo_op`` count under that op
    (only those whose ``hlo_module`` contains ``module``, if given); on device planes an
    untagged event (a copy, a kernel outside any op) counts under ``untagged:<its name>``.
    On the CPU backend "/host:CPU" holds the thunks, which the CPU smoke run reads; its
    untagged events are Python frames and are skipped."""
    out = defaultdict(lambda: [0, 0.0])
    keep_untagged = device_prefix.startswith("/device:")
    for plane in profile.planes:
        if not plane.name.startswith(device_prefix):
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                if op is None:
                    if not keep_untagged:
                        continue
                    op = f"untagged:{event.name}"
                elif module is not None and module not in str(stats.get("hlo_module", "")):
                    continue
                entry = out[str(op)]
                entry[0] += 1
                entry[1] += float(event.duration_ns)
    return {k: (v[0], v[1]) for k, v in out.items()}


def idle_before(profile, *, module: str | None, device_prefix: str = "/device:") -> dict:
    """HLO op name -> ns the device sat idle just before that op's kernels started, summed:
    on each plane whose name starts with ``device_prefix``, the events tagged ``hlo_op`` (of
    ``module``, if given) in start order, and for each the time since the latest end of any
    event before it. An op with much idle before it waited for the host to launch it (the
    first op of each step carries the host's dispatch of the step)."""
    out = defaultdict(float)
    for plane in profile.planes:
        if not plane.name.startswith(device_prefix):
            continue
        events = []
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                if op is None:
                    continue
                if module is not None and module not in str(stats.get("hlo_module", "")):
                    continue
                events.append((float(event.start_ns), float(event.duration_ns), str(op)))
        events.sort()
        busy_until = None
        for start, duration, op in events:
            if busy_until is not None and start > busy_until:
                out[op] += start - busy_until
            end = start + duration
            busy_until = end if busy_until is None else max(busy_until, end)
    return dict(out)


def profile_step(call, *, steps: int, warmup: int = 2, module: str | None, device_prefix: str):
    """(op -> (kernels, ns), op -> idle ns before it) summed over ``steps`` calls of ``call``,
    which returns a JAX value (``device_op_times``, ``idle_before``)."""
    import glob

    import jax
    from jax.profiler import ProfileData

    for _ in range(warmup):
        jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                jax.block_until_ready(call())
        (path,) = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        profile = ProfileData.from_file(path)
        return (
            device_op_times(profile, module=module, device_prefix=device_prefix),
            idle_before(profile, module=module, device_prefix=device_prefix),
        )


#: The jitted programs a profile can take: the training step (value-and-grad, then AdamW) and
#: the value-and-grad alone (``bench_model_jax``'s grad_ms row).
PROGRAMS = ("train", "grad")


def provider_rows(
    name: str,
    rank: int,
    *,
    layers: int,
    steps: int,
    tiny: bool,
    out: pathlib.Path | None,
    program: str = "train",
):
    """Profile one provider's ``program`` (``PROGRAMS``); rows per HLO op (µs and kernels per
    step)."""
    import jax
    import jax.numpy as jnp

    from benchmarks import bench_model_jax as bm

    model = bm.build_base(layers, tiny=tiny)
    vocab, seq = bm.vocab_and_seq(tiny)
    ids = jax.random.randint(jax.random.key(0), (bm.BATCH, seq), 0, vocab, dtype=jnp.int32)
    bm.adapt(model, name, rank)
    with bm.norm_gemm_bf16x3(name != "ours_bf16_f32_gram"):
        _, value_and_grad, adapters, rest = bm.step_functions(model)
        if program == "train":
            train, state = bm.train_step(value_and_grad, adapters)
            compiled = train.lower(state[0], state[1], rest, ids).compile()
        else:
            compiled = jax.jit(value_and_grad).lower(adapters, rest, ids).compile()
    hlo = compiled.as_text()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        suffix = "" if program == "train" else f"_{program}"
        (out / f"profile_jax_{name}_r{rank}{suffix}.hlo.txt").write_text(hlo)
    module = re.search(r"HloModule\s+([\w.\-]+)", hlo)

    def call():
        if program == "grad":
            return compiled(adapters, rest, ids)[0]
        state[0], state[1], loss = compiled(state[0], state[1], rest, ids)
        return loss

    step_ms = jax_time_ms(call)
    on_cpu = jax.default_backend() == "cpu"
    times, idle = profile_step(
        call,
        steps=steps,
        module=module.group(1) if module else None,
        device_prefix="/host:CPU" if on_cpu else "/device:",
    )
    ops = hlo_op_table(hlo)
    rows = []
    for op, (kernels, ns) in sorted(times.items(), key=lambda kv: -kv[1][1]):
        info = ops.get(op, dict(opcode="?", kind="", shape="", scope=""))
        rows.append(
            dict(
                provider=name,
                program=program,
                rank=rank,
                layers=layers,
                step_ms=step_ms,
                op=op,
                **info,
                kernels_per_step=kernels / steps,
                us_per_step=ns / steps / 1e3,
                idle_before_us_per_step=idle.get(op, 0.0) / steps / 1e3,
            )
        )
    return rows


def by_kind(rows: list[dict], key: str = "us_per_step") -> dict[tuple[str, str], float]:
    """µs per step (``key``: device time, or idle before) summed per (opcode, kind)."""
    out = defaultdict(float)
    for row in rows:
        out[(row["opcode"], row["kind"])] += row.get(key, 0.0)
    return dict(out)


def by_scope(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """scope -> (µs, kernels) per step (``hlo_op_table``'s scope; "" for the rest), largest
    first."""
    out = defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        entry = out[row.get("scope", "")]
        entry[0] += row["us_per_step"]
        entry[1] += row["kernels_per_step"]
    return {k: (v[0], v[1]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][0])}


def _label(row: dict) -> str:
    """A row's provider, with its program unless that is the training step."""
    program = row.get("program", "train")
    return row["provider"] if program == "train" else f"{row['provider']} ({program})"


def report(rows: list[dict], *, top: int = 12) -> str:
    """A text summary: device µs per step per provider (and program) and rank, each one's top
    ops, and per (opcode, kind) the difference of every one against the first of its rank."""
    lines = []
    for rank in sorted({r["rank"] for r in rows}):
        mine = [r for r in rows if r["rank"] == rank]
        names = list(dict.fromkeys(_label(r) for r in mine))
        kinds = {n: by_kind([r for r in mine if _label(r) == n]) for n in names}
        for n in names:
            ops = [r for r in mine if _label(r) == n]
            total = sum(r["us_per_step"] for r in ops)
            kernels = sum(r["kernels_per_step"] for r in ops)
            idle = sum(r.get("idle_before_us_per_step", 0.0) for r in ops)
            lines.append(f"r={rank} {n}: {total:.1f} us device time per step, {kernels:.0f} "
                         f"kernels, {idle:.1f} us idle between them; step wall time "
                         f"{ops[0]['step_ms']:.2f} ms")  # fmt: skip
            for r in ops[:top]:
                what = f"{r['op']}  {r['opcode']} {r['kind']}  {r['shape'][:60]}"
                lines.append(
                    f"    {r['us_per_step']:9.1f} us  x{r['kernels_per_step']:.0f}  {what}"
                )
            parts = by_scope(ops)
            if any(parts):
                listing = ", ".join(f"{k or 'rest'} {us:.0f} us in {kernels:.0f} kernels"
                                    for k, (us, kernels) in parts.items())  # fmt: skip
                lines.append(f"  r={rank} {n}, by dora_jax part: {listing}")
            if not any("idle_before_us_per_step" in r for r in ops):
                continue
            waits = sorted(ops, key=lambda r: -r["idle_before_us_per_step"])[:top]
            lines.append(f"  r={rank} {n}, idle before, by op (and by (opcode, kind)):")
            for r in waits:
                what = f"{r['op']}  {r['opcode']} {r['kind']}  {r['shape'][:60]}"
                lines.append(f"    {r['idle_before_us_per_step']:9.1f} us idle before  {what}")
            for k, v in sorted(by_kind(ops, "idle_before_us_per_step").items(),
                               key=lambda kv: -kv[1])[:6]:  # fmt: skip
                lines.append(f"    {v:9.1f} us idle before  {k[0]} {k[1]}")
        ref = names[0]
        for n in names[1:]:
            lines.append(f"r={rank} {n} - {ref}, us per step by (opcode, kind):")
            diff = {k: kinds[n].get(k, 0.0) - kinds[ref].get(k, 0.0)
                    for k in set(kinds[n]) | set(kinds[ref])}  # fmt: skip
            for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1])):
                if abs(d) >= 0.5:
                    lines.append(f"    {d:+9.1f}  {k[0]} {k[1]}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--providers", nargs="+", default=["jnp_lora", "ours_bf16"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="profiled steps (after 2 warm-ups)")
    ap.add_argument("--programs", nargs="+", choices=PROGRAMS, default=["train"],
                    help="which jitted programs to profile, in report order")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="the small model (CPU smoke)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    from benchmarks.bench_model_jax import PROVIDERS

    unknown = [p for p in args.providers if p not in PROVIDERS]
    if unknown:
        ap.error(f"--providers: unknown {unknown}; known: {list(PROVIDERS)}")
    if args.steps < 1 or args.layers < 1:
        ap.error(f"--steps and --layers must be >= 1; got {args.steps}, {args.layers}")
    rows = []
    for rank in args.ranks:
        for name in args.providers:
            for program in args.programs:
                rows += provider_rows(name, rank, layers=args.layers, steps=args.steps,
                                      tiny=args.tiny, out=args.out, program=program)  # fmt: skip
    print(report(rows), flush=True)
    if args.out is not None:
        write_csv(args.out / "profile_jax.csv", rows)
    return rows


def disable_command_buffers() -> None:
    """Turn XLA's GPU command buffers off for this process, so the trace records every kernel
    under its own HLO op instead of one command-buffer op per program. Effective only before
    JAX starts its GPU backend."""
    if NO_COMMAND_BUFFERS not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_COMMAND_BUFFERS}".strip()


if __name__ == "__main__":
    disable_command_buffers()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
