"""JAX DoRA layer on the GPU: ours (Pallas and XLA) vs naive jnp DoRA vs jnp LoRA.

Same shapes as the torch layer benchmark. bf16 activations and kernel; our adapters are f32
parameters (the library default, cast per call); the baselines run entirely in bf16, as
measured in DESIGN §5, so no win comes from lower precision. Forward = y; grad = y and the
VJP w.r.t. x and the adapter (x, a, b[, m]) with a fixed random cotangent. Times are medians
over repetitions of a batch of calls that rotates through several input sets; memory is
XLA's compiled temp size (``memory_analysis().temp_size_in_bytes``).

    python3 -m benchmarks.run --only jax_layer --skip-tests
"""

from __future__ import annotations

import os
import statistics
import time
import traceback

# benchmarks.run imports every bench into one process: keep JAX from reserving 75% of the GPU
# before the torch benchmarks run (only effective if JAX has not started yet).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

from benchmarks.measure import write_csv
from dora_jax.baselines import lora_dense, naive_dora_dense
from dora_jax.functional import dora_dense, resolved_impls
from dora_jax.norm import factored_norm

BENCH = "jax_layer"
BF16 = jnp.bfloat16
# (name, d_in, d_out, rank, tokens, mode): "train" times forward and grad with the norm computed
# in the call; "infer" times the forward with the norm precomputed (frozen adapter).
SHAPES = [
    ("8192x8192_r16_t4096", 8192, 8192, 16, 4096, "train"),
    ("8192x8192_r128_t4096", 8192, 8192, 128, 4096, "train"),
    ("8192x8192_r384_t4096", 8192, 8192, 384, 4096, "train"),
    ("8192x28672_r384_t2048", 8192, 28672, 384, 2048, "train"),
    ("4096x4096_r384_t512_infer", 4096, 4096, 384, 512, "infer"),
]
HEADLINE = "8192x8192_r384_t4096"
INFER = "4096x4096_r384_t512_infer"
N_INPUTS, BATCH, REPS, WARMUP = 3, 10, 12, 3
SCALING = 2.0


def _inputs(d_in, d_out, r, tokens, seed):
    ks = jax.random.split(jax.random.key(seed), 8)
    kernel = (jax.random.normal(ks[0], (d_in, d_out)) / d_in**0.5).astype(BF16)
    a = jax.random.uniform(ks[1], (d_in, r), minval=-1, maxval=1) / d_in**0.5
    b = jax.random.normal(ks[2], (r, d_out)) / (SCALING * r**0.5)
    m = 1.0 + 0.1 * jax.random.normal(ks[3], (d_out,))
    bias = jax.random.normal(ks[4], (d_out,)).astype(BF16)
    xs = [jax.random.normal(k, (tokens, d_in), BF16) for k in jax.random.split(ks[5], N_INPUTS)]
    dys = [jax.random.normal(k, (tokens, d_out), BF16) for k in jax.random.split(ks[6], N_INPUTS)]
    return kernel, a, b, m, bias, xs, dys


def _providers(kernel, a, b, m, bias, mode):
    """name -> (fn(x, *trainable), trainable tuple). Baselines get bf16 adapters."""
    a16, b16, m16 = a.astype(BF16), b.astype(BF16), m.astype(BF16)
    norm = factored_norm(kernel, a, b, SCALING) if mode == "infer" else None

    def ours(impl):
        def f(x, a, b, m):
            return dora_dense(x, kernel, a, b, m, SCALING, bias, impl=impl, norm=norm)

        return f, (a, b, m)

    return {
        "lora": (lambda x, a, b: lora_dense(x, kernel, a, b, SCALING, bias), (a16, b16)),
        "naive_dora": (
            lambda x, a, b, m: naive_dora_dense(x, kernel, a, b, m, SCALING, bias),
            (a16, b16, m16),
        ),
        "ours_xla": ours("xla"),
        "ours_pallas": ours("pallas"),
        "ours_auto": ours("auto"),
    }


def _fwd(f):
    return jax.jit(f)


def _grad(f):
    def step(x, dy, *params):
        y, pull = jax.vjp(f, x, *params)
        return y, pull(dy)

    return jax.jit(step)


def _time(fn, arg_sets) -> float:
    """Median seconds per call: REPS batches of BATCH calls rotating through arg_sets."""
    for i in range(WARMUP):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    samples = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        out = None
        for i in range(BATCH):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / BATCH)
    return statistics.median(samples)


def _temp_bytes(fn, args) -> float:
    analysis = fn.lower(*args).compile().memory_analysis()
    return float("nan") if analysis is None else float(analysis.temp_size_in_bytes)


def _measure(shape):
    name, d_in, d_out, r, tokens, mode = shape
    kernel, a, b, m, bias, xs, dys = _inputs(d_in, d_out, r, tokens, seed=0)
    auto = resolved_impls((tokens, d_in), (d_in, d_out), r)
    auto_str = ",".join(f"{k}={v}" for k, v in auto.items())
    rows = []
    for prov, (f, params) in _providers(kernel, a, b, m, bias, mode).items():
        kinds = [("fwd", _fwd(f), [(x, *params) for x in xs])]
        if mode == "train":
            kinds.append(("grad", _grad(f), [(x, dy, *params) for x, dy in zip(xs, dys)]))
        for kind, fn, arg_sets in kinds:
            row = dict(
                shape=name,
                d_in=d_in,
                d_out=d_out,
                rank=r,
                tokens=tokens,
                mode=mode,
                provider=prov,
                kind=kind,
                auto_impl=auto_str,
                ms=None,
                temp_mib=None,
                error="",
            )
            try:
                row["temp_mib"] = _temp_bytes(fn, arg_sets[0]) / 2**20
                row["ms"] = _time(fn, arg_sets) * 1e3
            except Exception as e:  # one failing provider must not stop the others
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(
                f"[{BENCH}] {name} {prov} {kind}: ms={row['ms']} temp={row['temp_mib']} "
                f"{row['error']}",
                flush=True,
            )
            rows.append(row)
    return rows


def _get(rows, shape, prov, kind, key="ms"):
    for r in rows:
        if (r["shape"], r["provider"], r["kind"]) == (shape, prov, kind):
            return r[key]
    return None


def _ratio(num, den):
    return None if num is None or den is None or den == 0 else num / den


def _summary(rows):
    out = []

    def add(metric, value, target=None, ok=None):
        out.append(dict(bench=BENCH, metric=metric, value=value, target=target, ok=ok))

    for kind in ("fwd", "grad"):
        lora = _get(rows, HEADLINE, "lora", kind)
        for prov in ("ours_auto", "ours_xla", "ours_pallas"):
            v = _ratio(_get(rows, HEADLINE, prov, kind), lora)
            add(f"{HEADLINE} {kind} {prov}/lora", v, "<= 1.10", None if v is None else v <= 1.10)
    for prov in ("ours_auto", "ours_xla", "ours_pallas"):
        v = _ratio(_get(rows, HEADLINE, "naive_dora", "fwd"), _get(rows, HEADLINE, prov, "fwd"))
        add(
            f"{HEADLINE} fwd naive_dora/{prov} (speedup)",
            v,
            ">= 1.25",
            None if v is None else v >= 1.25,
        )
    v = _ratio(_get(rows, INFER, "ours_auto", "fwd"), _get(rows, INFER, "lora", "fwd"))
    add(
        f"{INFER} fwd ours_auto/lora (norm precomputed)",
        v,
        "<= 1.10",
        None if v is None else v <= 1.10,
    )

    # Memory: the norm may add O(d_out·r) f32 (U, G·b, P, db: budget 8 such matrices); the grad
    # also keeps one [T, d_out] activation for dm (trainable magnitude needs Σ_t dy ⊙ inner).
    _, _, d_out, r, tokens, _ = next(s for s in SHAPES if s[0] == HEADLINE)
    small = 8 * d_out * r * 4 / 2**20
    act = tokens * d_out * 2 / 2**20
    for kind, budget in (("fwd", small), ("grad", small + act)):
        extra = None
        ours = _get(rows, HEADLINE, "ours_auto", kind, "temp_mib")
        lora = _get(rows, HEADLINE, "lora", kind, "temp_mib")
        if ours is not None and lora is not None:
            extra = ours - lora
        add(
            f"{HEADLINE} {kind} temp MiB ours_auto - lora",
            extra,
            f"<= {budget:.0f}",
            None if extra is None else extra <= budget,
        )
    return out


def run(out_dir) -> list[dict]:
    rows = []
    for shape in SHAPES:
        try:
            rows += _measure(shape)
        except Exception as e:  # e.g. out of memory building one shape's inputs
            traceback.print_exc()
            rows.append(dict(shape=shape[0], provider="*", kind="*", error=repr(e)[:300]))
    path = out_dir / "jax_layer.csv"
    fields = [
        "shape",
        "d_in",
        "d_out",
        "rank",
        "tokens",
        "mode",
        "provider",
        "kind",
        "auto_impl",
        "ms",
        "temp_mib",
        "error",
    ]
    write_csv(path, rows, fields)
    print(f"[{BENCH}] wrote {path}", flush=True)
    return _summary(rows)
