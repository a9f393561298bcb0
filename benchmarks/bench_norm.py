"""DoRA's weight norm ‖W + s·B·A‖_row: dense (as PEFT builds it) vs factored, time and memory.

Providers (torch, PyTorch layout W [d_out, d_in], A [r, d_in], B [d_out, r]):
  - ``dense``: ``linalg.norm(W + s·(B @ A), dim=1)`` in the working dtype — the textbook form;
  - ``peft``: PEFT 0.21's own code path (``DoraLinearLayer.get_lora_weight``, which pushes an
    identity matrix [d_in, d_in] through lora_A and lora_B, then ``get_weight_norm``);
  - ``factored``: ``dora_torch.factored_norm`` with ‖W‖² cached (W is frozen: what the layer does);
  - ``factored_cold``: the same, computing ‖W‖² as well.
JAX (Flax layout): ``dense_jnp`` (jnp ``norm(K + s·a·b, axis=0)``, jitted) vs
``dora_jax.factored_norm`` (jitted), on a few shapes only.

Memory: torch — peak bytes the caching allocator saw during one call over what was resident
before (W, A, B, the cached ‖W‖²): the norm's transient. JAX — XLA's compiled temp size.
Time: median of CUDA-event-timed calls (torch) / wall time to ready (JAX) after warm-up.

    python3 -m benchmarks.run --only norm --skip-tests
"""

from __future__ import annotations

import math
import os
import pathlib

from benchmarks.measure import error_text, write_csv

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

# (d_out, d_in): square 4096² and 8192², and both orientations of the 8192↔28672 MLP shape.
SHAPES = [(4096, 4096), (8192, 8192), (28672, 8192), (8192, 28672)]
RANKS = (16, 64, 128, 256, 384, 512)
JAX_SHAPES = [(8192, 8192), (28672, 8192)]
JAX_RANKS = (16, 384)
TORCH_PROVIDERS = ("dense", "peft", "factored", "factored_cold")
# The headline: layer 8192 → 28672 (d_in = 8192, d_out = 28672), r = 384, as in issue 3.
HEADLINE = (28672, 8192, 384)
MIN_MEMORY_RATIO = 20.0  # PEFT's norm transient / ours, at the headline shape


def _row(backend, dtype, d_out, d_in, r, provider) -> dict:
    """A result row before measuring (NaN time, -1 bytes: what a failed measurement leaves)."""
    return dict(backend=backend, dtype=dtype, d_out=d_out, d_in=d_in, r=r, provider=provider,
                ms=float("nan"), transient_bytes=-1, error="")  # fmt: skip


def _torch_inputs(d_out, d_in, r, dtype, scaling):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    W = torch.randn(d_out, d_in, device="cuda", dtype=dtype, generator=g) / math.sqrt(d_in)
    A = torch.randn(r, d_in, device="cuda", dtype=dtype, generator=g) / math.sqrt(d_in)
    B = torch.randn(d_out, r, device="cuda", dtype=dtype, generator=g) / (scaling * math.sqrt(r))
    return W, A, B


def _torch_provider(name, W, A, B, scaling):
    """A zero-argument callable computing the norm the way ``name`` does."""
    import torch

    import dora_torch

    if name == "dense":
        return lambda: torch.linalg.norm(W + scaling * (B @ A), dim=1)
    if name == "peft":
        from peft.tuners.lora.dora import DoraLinearLayer

        layer = DoraLinearLayer(fan_in_fan_out=False)
        lora_A = torch.nn.Linear(A.shape[1], A.shape[0], bias=False, device="cuda", dtype=A.dtype)
        lora_B = torch.nn.Linear(B.shape[1], B.shape[0], bias=False, device="cuda", dtype=B.dtype)
        lora_A.weight.data, lora_B.weight.data = A, B

        def peft():
            lora_weight = layer.get_lora_weight(lora_A=lora_A, lora_B=lora_B).to(W.dtype)
            return layer.get_weight_norm(W, lora_weight.detach(), scaling)

        return peft
    if name == "factored":
        base_sq = dora_torch.base_sq_norm(W)
        return lambda: dora_torch.factored_norm(W, A, B, scaling, base_sq=base_sq)
    if name == "factored_cold":
        return lambda: dora_torch.factored_norm(W, A, B, scaling)
    raise ValueError(f"unknown provider {name!r}")


def _bench_torch(rows):
    import torch

    from .measure import cuda_peak_bytes, cuda_time_ms, free_cuda

    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for d_out, d_in in SHAPES:
            for r in RANKS:
                scaling = 2.0  # alpha = 2r
                W, A, B = _torch_inputs(d_out, d_in, r, dtype, scaling)
                for name in TORCH_PROVIDERS:
                    row = _row("torch", dtype_name, d_out, d_in, r, name)
                    try:
                        with torch.no_grad():
                            fn = _torch_provider(name, W, A, B, scaling)
                            row["transient_bytes"] = cuda_peak_bytes(fn)
                            row["ms"] = cuda_time_ms(fn, warmup=3, iters=10)
                    except torch.cuda.OutOfMemoryError as e:
                        row["error"] = error_text(e)
                    rows.append(row)
                    free_cuda()
                del W, A, B
                free_cuda()


def _bench_jax(rows):
    import jax
    import jax.numpy as jnp

    import dora_jax

    from .measure import jax_temp_bytes, jax_time_ms

    def dense(kernel, a, b, s):
        w = kernel + s * (a @ b)
        return jnp.sqrt(jnp.sum(jnp.square(w.astype(jnp.float32)), axis=0))

    for dtype_name, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
        for d_out, d_in in JAX_SHAPES:
            for r in JAX_RANKS:
                key = jax.random.split(jax.random.key(0), 3)
                kernel = (jax.random.normal(key[0], (d_in, d_out)) / math.sqrt(d_in)).astype(dtype)
                a = (jax.random.normal(key[1], (d_in, r)) / math.sqrt(d_in)).astype(dtype)
                b = (jax.random.normal(key[2], (r, d_out)) / (2.0 * math.sqrt(r))).astype(dtype)
                base_sq = dora_jax.base_sq_norm(kernel)
                fns = {
                    "dense_jnp": jax.jit(lambda k, a, b, _bsq: dense(k, a, b, 2.0)),
                    "factored": jax.jit(
                        lambda k, a, b, bsq: dora_jax.factored_norm(k, a, b, 2.0, base_sq=bsq)
                    ),
                }
                for name, fn in fns.items():
                    row = _row("jax", dtype_name, d_out, d_in, r, name)
                    try:
                        args = (kernel, a, b, base_sq)
                        temp = jax_temp_bytes(fn, *args)
                        row["transient_bytes"] = -1 if temp is None else temp
                        row["ms"] = jax_time_ms(lambda fn=fn, args=args: fn(*args))
                    except Exception as e:  # one failing JAX config must not end the torch rows
                        row["error"] = error_text(e)
                    rows.append(row)
                del kernel, a, b, base_sq


def _find(rows, **key):
    for r in rows:
        if all(r[k] == v for k, v in key.items()):
            return r
    return None


def _summary(rows) -> list[dict]:
    d_out, d_in, r = HEADLINE
    out = []
    for dtype in ("bf16", "fp32"):
        at = dict(backend="torch", dtype=dtype, d_out=d_out, d_in=d_in, r=r)
        ours, peft, dense = (_find(rows, provider=p, **at) for p in ("factored", "peft", "dense"))
        if not (ours and peft and dense) or ours["transient_bytes"] <= 0:
            continue
        tag = f"{d_in}->{d_out} r={r} {dtype}"
        mem = peft["transient_bytes"] / ours["transient_bytes"]
        out.append(
            dict(
                bench="norm",
                metric=f"transient PEFT/ours ({tag})",
                value=mem,
                target=f">= {MIN_MEMORY_RATIO:g}",
                ok=mem >= MIN_MEMORY_RATIO,
            )
        )
        out.append(
            dict(
                bench="norm",
                metric=f"transient ours MiB ({tag})",
                value=ours["transient_bytes"] / 2**20,
            )
        )
        out.append(
            dict(bench="norm", metric=f"time PEFT/ours ({tag})", value=peft["ms"] / ours["ms"])
        )
        out.append(
            dict(bench="norm", metric=f"time dense/ours ({tag})", value=dense["ms"] / ours["ms"])
        )
    return out


def run(out_dir: pathlib.Path) -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("bench_norm needs a CUDA GPU")
    rows: list[dict] = []
    out_dir = pathlib.Path(out_dir)
    _bench_torch(rows)
    write_csv(out_dir / "norm.csv", rows)  # kept if the JAX half is cut short
    try:
        _bench_jax(rows)
    except ImportError as e:  # dora_jax/jax missing: the torch half still stands
        print(f"[bench_norm] JAX part skipped: {e}")
    write_csv(out_dir / "norm.csv", rows)
    _plot(rows, out_dir / "norm_memory.png")
    return _summary(rows)


def _plot(rows, path) -> None:
    from .plots import line_plot

    d_out, d_in, _ = HEADLINE
    series = {}
    for provider in TORCH_PROVIDERS:
        for dtype in ("bf16", "fp32"):
            pts = [
                (r["r"], r["transient_bytes"] / 2**20)
                for r in rows
                if r["backend"] == "torch"
                and r["provider"] == provider
                and r["dtype"] == dtype
                and (r["d_out"], r["d_in"]) == (d_out, d_in)
                and r["transient_bytes"] > 0
            ]
            if pts:
                series[f"{provider} {dtype}"] = ([p[0] for p in pts], [p[1] for p in pts])
    line_plot(
        path,
        series,
        title=f"norm transient, {d_in}->{d_out}",
        xlabel="rank r",
        ylabel="peak transient (MiB)",
        logy=True,
    )
