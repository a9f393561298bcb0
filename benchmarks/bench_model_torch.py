"""Model level: the training step users run, on a Llama-8B-shaped model, eager and compiled.

Model: hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 32000, random bf16
weights, FEWER LAYERS than Llama-3-8B's 32 (default 8). DoRA/LoRA on all seven projections,
``lora_alpha = 2r``, dropout 0. Input: random token ids, seq 2048, batch 1 (host-bound) or 4
(GPU-bound).

Providers (the base model is built once and re-wrapped for each, then unwrapped):
  - ``peft_lora_fp32`` / ``peft_lora_bf16``: PEFT LoRA, adapters fp32 (PEFT's default,
    ``autocast_adapter_dtype=True``) / bf16 (``autocast_adapter_dtype=False``);
  - ``peft_dora_fp32`` / ``peft_dora_bf16``: PEFT DoRA, the same two settings;
  - ``ours_fp32`` / ``ours_bf16``: the PEFT DoRA model of that setting run through
    ``dora_torch.accelerate_peft``;
  - ``ours_recompute_fp32`` / ``ours_recompute_bf16`` (asked for by name, not in the default
    list): ``ours_fp32`` / ``ours_bf16`` with ``recompute_modules=RECOMPUTE_MODULES``, the
    layers ``work_floor.cheapest_recompute`` picks for a batch-4 peak ≤ 1.05× PEFT LoRA's;
  - ``ours_stacked_fp32`` / ``ours_stacked_bf16`` (by name too): with
    ``stack_modules=".*"`` (every layer's W and A in one buffer: dx as one GEMM in eager
    calls, and x Wᵀ with x Aᵀ too under ``config.STACK_FORWARD``; README "Stacked weights");
  - ``ours_recompute_stacked_bf16`` (by name): both, the recomputed layers (which take the
    two-GEMM path) and the other four projections stacked.

Modes: ``eager``, ``compile`` (``torch.compile(model)``) and ``reduce-overhead``
(``torch.compile(model, mode="reduce-overhead")``, CUDA graphs). The optimizer step stays
eager in every mode (as in ``transformers.Trainer``).

Metrics, medians of CUDA-event-timed calls after warm-up:
  - ``train_ms``: one training step ``zero_grad → forward (LM loss) → backward →
    AdamW.step()``; ``optim`` says which AdamW (``foreach`` or ``fused``).
  - ``infer_ms``: a no-grad forward in eval mode (adapters unchanged between calls);
    ``infer_dora_cached_ms``: PEFT DoRA inside ``peft.helpers.DoraCaching`` (PEFT's own norm
    cache), so PEFT is compared cached against cached; ``infer_norm_recomputed_ms``: ours
    with every norm made stale before each call (a step of an optimizer over its parameters
    that changes none, ``norm_invalidator``), as inference right after each training update
    would run, beside ours' cached row and PEFT's uncached one.
  - ``train_peak_gib``: peak allocated during one step over what was allocated before it
    (weights, adapters, optimizer state).

``--grad-ckpt`` turns on transformers' activation checkpointing of every decoder layer
(non-reentrant), the usual setting when memory is short (column ``grad_ckpt``).

    python3 -m benchmarks.bench_model_torch --ranks 16 384 --batches 1 --modes eager compile
    python3 -m benchmarks.run --only model_torch --skip-tests      # the env defaults below

Environment defaults for ``benchmarks.run``: ``DORA_BENCH_LAYERS`` (8), ``DORA_BENCH_RANKS``
("16,384"), ``DORA_BENCH_BATCHES`` ("1,4"), ``DORA_BENCH_MODES``
("eager,compile,reduce-overhead"), ``DORA_BENCH_OPTIMS`` ("foreach,fused"),
``DORA_BENCH_PROVIDERS`` (all but the ``ours_recompute_*`` and ``ours_stacked_*`` ones).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pathlib
import pstats
import subprocess
import time
import traceback
import warnings
from datetime import UTC, datetime

from benchmarks.measure import cuda_time_ms, error_text, free_cuda, write_csv

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB, SEQ = 4096, 14336, 32, 8, 32000, 2048
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# name → (use_dora, autocast_adapter_dtype, accelerate with ours)
PROVIDERS = {
    "peft_lora_fp32": (False, True, False),
    "peft_lora_bf16": (False, False, False),
    "peft_dora_fp32": (True, True, False),
    "peft_dora_bf16": (True, False, False),
    "ours_fp32": (True, True, True),
    "ours_bf16": (True, False, True),
    "ours_recompute_fp32": (True, True, True),
    "ours_recompute_bf16": (True, False, True),
    "ours_stacked_fp32": (True, True, True),
    "ours_stacked_bf16": (True, False, True),
    "ours_recompute_stacked_bf16": (True, False, True),
}
#: accelerate_peft's recompute_modules per provider (work_floor.cheapest_recompute, batch 4).
RECOMPUTE_MODULES = ("q_proj", "k_proj", "o_proj")
RECOMPUTE = {"ours_recompute_fp32": RECOMPUTE_MODULES, "ours_recompute_bf16": RECOMPUTE_MODULES,
             "ours_recompute_stacked_bf16": RECOMPUTE_MODULES}  # fmt: skip
#: accelerate_peft's stack_modules per provider.
STACK = {"ours_stacked_fp32": ".*", "ours_stacked_bf16": ".*",
         "ours_recompute_stacked_bf16": ".*"}  # fmt: skip
DEFAULT_PROVIDERS = [p for p in PROVIDERS if p not in RECOMPUTE and p not in STACK]
MODES = ("eager", "compile", "reduce-overhead")
TRACE_STEP = "train_step"  # the profiler range around each profiled step
OPTIMS = ("foreach", "fused")
WARMUP = {"eager": 3, "compile": 4, "reduce-overhead": 6}
ITERS = 10
GIB = 2.0**30
FIELDS = [
    "provider", "mode", "optim", "rank", "batch", "layers", "train_ms", "infer_ms",
    "infer_dora_cached_ms", "infer_norm_recomputed_ms", "train_peak_gib", "grad_ckpt",
    "dora_config", "error",
]  # fmt: skip


def dora_config_overrides(pairs) -> dict:
    """``["NAME=VALUE", ...]`` → {NAME: value} for ``dora_torch.config`` (VALUE a Python
    literal); each NAME must already exist there."""
    import ast

    from dora_torch import config

    out = {}
    for pair in pairs or ():
        name, sep, text = pair.partition("=")
        if not sep or not hasattr(config, name):
            raise ValueError(f"--dora-config takes NAME=VALUE with NAME in dora_torch.config; "
                             f"got {pair!r}")  # fmt: skip
        out[name] = ast.literal_eval(text)
    return out


def _env_list(name: str, default: str) -> list[str]:
    return [v for v in os.environ.get(name, default).split(",") if v]


def build_base(n_layers: int):
    """The Llama-8B-shaped LlamaForCausalLM with ``n_layers`` layers, bf16 on CUDA, frozen."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=n_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly: no fp32 copy on the GPU
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def _wrap(base, name: str, rank: int):
    from peft import LoraConfig, get_peft_model

    use_dora, autocast, ours = PROVIDERS[name]
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        use_dora=use_dora,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
    )
    model = get_peft_model(base, config, autocast_adapter_dtype=autocast)
    if ours:
        import dora_torch

        dora_torch.accelerate_peft(
            model, recompute_modules=RECOMPUTE.get(name), stack_modules=STACK.get(name)
        )
    return model


def _unwrap(peft_model, base, originals) -> None:
    """Put the original nn.Linear modules back into ``base`` (PEFT wrapped them in place)."""
    try:
        peft_model.unload()
    finally:
        for name, module in originals.items():
            parent, _, attr = name.rpartition(".")
            setattr(base.get_submodule(parent), attr, module)


def _runner(model, mode: str):
    import torch

    if mode == "eager":
        return model
    return torch.compile(model, mode=None if mode == "compile" else mode)


def _mark_step(mode: str) -> None:
    import torch

    if mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()


def measure_train(model, run, ids, mode: str, optim: str) -> dict:
    """Median time and peak memory of zero_grad → forward → backward → AdamW.step()."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=optim == "foreach", fused=optim == "fused")
    model.train()

    def step():
        _mark_step(mode)
        opt.zero_grad(set_to_none=True)
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()

    try:
        ms = cuda_time_ms(step, warmup=WARMUP[mode], iters=ITERS)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / GIB
    finally:
        opt.zero_grad(set_to_none=True)
    return {"train_ms": ms, "train_peak_gib": peak}


def norm_invalidator(model):
    """A callable that makes every cached DoRA norm of ``model`` stale, as a training update
    does: one step of an optimizer that holds its trainable parameters and changes none (lr
    0; parameters without a gradient are skipped). ``dora_torch`` counts every
    ``torch.optim.Optimizer`` step (docs/design.md §8, rule 2), and the step's hook recomputes
    the norms of eval-mode modules whose W, A or B the stepped optimizer holds (the buffers
    compiled eval graphs read; eager calls then read the same entries)."""
    import torch

    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0).step


def measure_infer(
    model, run, ids, mode: str, *, dora_caching: bool = False, norm_recomputed: bool = False
) -> float:
    import torch

    model.eval()
    invalidate = norm_invalidator(model) if norm_recomputed else None

    def infer():
        _mark_step(mode)
        if invalidate is not None:
            invalidate()
        with torch.no_grad():
            return run(input_ids=ids).logits

    if not dora_caching:
        return cuda_time_ms(infer, warmup=WARMUP[mode], iters=ITERS)
    from peft.helpers import DoraCaching

    with DoraCaching():
        return cuda_time_ms(infer, warmup=WARMUP[mode], iters=ITERS)


def profile_train(
    model, run, ids, path: pathlib.Path, mode: str = "eager", optim: str = "foreach"
) -> None:
    """torch.profiler tables (device and host time per op) of 3 training steps of ``run``
    (``model`` itself or its compiled form, already warm; each ends in a synchronisation, so
    each starts on an idle GPU as the timed steps do), every op and kernel of them as CSV
    beside ``path`` (``.csv``: calls and self times, to diff two providers) and their
    timeline (``.trace.json.gz``, Chrome trace format; ``benchmarks.trace_gaps`` lists where
    the GPU waits for the host)."""
    import gzip
    import shutil

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=optim == "foreach", fused=optim == "fused")
    model.train()

    def step():
        _mark_step(mode)
        opt.zero_grad(set_to_none=True)
        run(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            with record_function(TRACE_STEP):  # synchronised, as measure_train's steps are
                step()
                torch.cuda.synchronize()
    trace = path.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    ka = prof.key_averages()
    write_csv(
        path.with_suffix(".csv"),
        [
            {"name": e.key, "calls": e.count,
             "self_device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3,
             "self_cpu_ms": e.self_cpu_time_total / 1e3}
            for e in ka
        ],
        ["name", "calls", "self_device_ms", "self_cpu_ms"],
    )  # fmt: skip
    # Host-device synchronizations inside one step serialize host and GPU time: list them.
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught)
    with path.open("w") as f:
        f.write(f"synchronizing calls in one step: {sum(syncs.values())}\n")
        for where, count in syncs.most_common():
            f.write(f"  {count:5d}  {where}\n")
        f.write(ka.table(sort_by="self_cuda_time_total", row_limit=60))
        f.write("\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40))
        # Python-level host time (what the op table above cannot attribute).
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        profiler.disable()
        stats = pstats.Stats(profiler, stream=f)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
    opt.zero_grad(set_to_none=True)


def code_version() -> str:
    """``DORA_COMMIT`` if set, else git's HEAD, marked ``+modified`` when tracked files differ
    from it (a device checkout can carry a working tree newer than its HEAD)."""
    if os.environ.get("DORA_COMMIT"):
        return os.environ["DORA_COMMIT"]

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if head and git("status", "--porcelain", "--untracked-files=no"):
        head += "+modified"
    return head


def _meta() -> dict:
    import torch

    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": code_version(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        # Inductor settings from the environment (e.g. TORCHINDUCTOR_STATIC_LAUNCH_...): A/Bs
        # of compiled rows differ only here
        "inductor_env": " ".join(
            f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("TORCHINDUCTOR_")
        ),
    }


def bench(
    out_dir: pathlib.Path,
    *,
    layers: int,
    ranks: list[int],
    batches: list[int],
    modes: list[str],
    optims: list[str],
    providers: list[str],
    profile: list[str] = (),
    grad_ckpt: bool = False,
    dora_config: dict | None = None,
) -> list[dict]:
    """``dora_config``: ``dora_torch.config`` values set for the whole run (ours' rows)."""
    import torch

    from dora_torch import config

    for name, value in (dora_config or {}).items():
        setattr(config, name, value)
    config_tag = " ".join(f"{k}={v!r}" for k, v in (dora_config or {}).items())

    if not torch.cuda.is_available():
        raise RuntimeError("bench_model_torch needs a CUDA GPU")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = _meta()
    print(f"[model_torch] {meta}; {layers} layers, ranks {ranks}, batches {batches}", flush=True)
    base = build_base(layers)
    originals = {n: m for n, m in base.named_modules() if n.rsplit(".", 1)[-1] in TARGET_MODULES}
    rows = []
    for rank in ranks:
        for batch in batches:
            ids = torch.randint(0, VOCAB, (batch, SEQ), device="cuda")
            for name in providers:
                model = None
                try:
                    torch.manual_seed(0)
                    model = _wrap(base, name, rank)
                    if grad_ckpt:  # HF activation checkpointing of every decoder layer
                        base.gradient_checkpointing_enable({"use_reentrant": False})
                    for mode in modes:
                        torch._dynamo.reset()
                        run = _runner(model, mode)
                        t0 = time.time()
                        infer = {"error": ""}
                        try:
                            infer["infer_ms"] = measure_infer(model, run, ids, mode)
                            if name.startswith("peft_dora"):
                                infer["infer_dora_cached_ms"] = measure_infer(
                                    model, run, ids, mode, dora_caching=True
                                )
                            if PROVIDERS[name][2]:  # ours
                                infer["infer_norm_recomputed_ms"] = measure_infer(
                                    model, run, ids, mode, norm_recomputed=True
                                )
                        except Exception as e:
                            traceback.print_exc()
                            infer["error"] = error_text(e)
                        for optim in optims:
                            row = dict(
                                meta, provider=name, mode=mode, optim=optim, rank=rank,
                                batch=batch, layers=layers, grad_ckpt=grad_ckpt,
                                dora_config=config_tag, **infer,
                            )  # fmt: skip
                            try:
                                row.update(measure_train(model, run, ids, mode, optim))
                            except Exception as e:
                                traceback.print_exc()
                                row["error"] = (row["error"] + " | " + error_text(e)).strip(" |")
                            rows.append(row)
                            print(
                                f"[model_torch] {_fmt(row)} ({time.time() - t0:.0f}s)", flush=True
                            )
                        if name in profile:  # after this provider's timing in this mode
                            path = out_dir / f"profile_{name}_{mode}_r{rank}_b{batch}.txt"
                            profile_train(model, run, ids, path, mode)
                        del run
                except Exception as e:  # one failing provider must not end the others
                    traceback.print_exc()
                    rows.append(
                        dict(meta, provider=name, rank=rank, batch=batch, error=error_text(e))
                    )
                finally:
                    if grad_ckpt:
                        base.gradient_checkpointing_disable()
                    if model is not None:
                        _unwrap(model, base, originals)
                    del model
                    torch._dynamo.reset()
                    free_cuda()
                write_csv(out_dir / "model_torch.csv", rows, [*meta, *FIELDS])
    _plot(out_dir / "model_torch.png", rows)
    return _summary(rows)


def _fmt(row: dict) -> str:
    keys = ("provider", "mode", "optim", "rank", "batch")
    head = " ".join(str(row.get(k)) for k in keys)
    vals = ", ".join(f"{k}={row[k]:.4g}" for k in FIELDS if isinstance(row.get(k), float))
    return f"{head}: {vals}" + (f" ERROR {row['error']}" if row.get("error") else "")


def _plot(path: pathlib.Path, rows: list[dict]) -> None:
    """One bar panel per (rank, batch): train_ms of each provider, grouped by mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in rows if isinstance(r.get("train_ms"), float) and r.get("optim") == "foreach"]
    panels = sorted({(r["rank"], r["batch"]) for r in ok})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (rank, batch) in zip(axes[0], panels):
        sel = [r for r in ok if (r["rank"], r["batch"]) == (rank, batch)]
        modes = [m for m in MODES if any(r["mode"] == m for r in sel)]
        names = [p for p in PROVIDERS if any(r["provider"] == p for r in sel)]
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            vals = [
                next((r["train_ms"] for r in sel if r["provider"] == name and r["mode"] == m), 0)
                for m in modes
            ]
            ax.bar([j + i * width for j in range(len(modes))], vals, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(modes))], modes)
        ax.set(title=f"r={rank}, batch {batch}x{SEQ}", ylabel="training step, ms (AdamW foreach)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _summary(rows: list[dict]) -> list[dict]:
    """Ratios within this run: ours against PEFT LoRA and PEFT DoRA of the same setting."""
    out = []
    index = {
        (r["provider"], r.get("mode"), r.get("optim"), r["rank"], r["batch"]): r
        for r in rows
        if isinstance(r.get("train_ms"), float)
    }
    for (prov, mode, optim, rank, batch), r in index.items():
        if not prov.startswith("ours"):
            continue
        ours, setting = prov.rsplit("_", 1)
        tag = f"r={rank} b={batch} {mode} {optim} {setting}-adapters"
        lora = index.get((f"peft_lora_{setting}", mode, optim, rank, batch))
        dora = index.get((f"peft_dora_{setting}", mode, optim, rank, batch))
        if lora:
            out.append(
                dict(bench="model_torch", metric=f"{ours}/LoRA train [{tag}]",
                     value=r["train_ms"] / lora["train_ms"])
            )  # fmt: skip
            if isinstance(r.get("train_peak_gib"), float) and lora.get("train_peak_gib"):
                out.append(
                    dict(bench="model_torch", metric=f"{ours}/LoRA peak memory [{tag}]",
                         value=r["train_peak_gib"] / lora["train_peak_gib"])
                )  # fmt: skip
        if dora:
            out.append(
                dict(bench="model_torch", metric=f"DoRA/{ours} train [{tag}]",
                     value=dora["train_ms"] / r["train_ms"])
            )  # fmt: skip
    return out


def run(out_dir: pathlib.Path) -> list[dict]:
    """``benchmarks.run`` entry point: the configuration from the environment."""
    return bench(
        out_dir,
        layers=int(os.environ.get("DORA_BENCH_LAYERS", "8")),
        ranks=[int(v) for v in _env_list("DORA_BENCH_RANKS", "16,384")],
        batches=[int(v) for v in _env_list("DORA_BENCH_BATCHES", "1,4")],
        modes=_env_list("DORA_BENCH_MODES", ",".join(MODES)),
        optims=_env_list("DORA_BENCH_OPTIMS", ",".join(OPTIMS)),
        providers=_env_list("DORA_BENCH_PROVIDERS", ",".join(DEFAULT_PROVIDERS)),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 384])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--optims", nargs="+", default=list(OPTIMS), choices=OPTIMS)
    ap.add_argument("--providers", nargs="+", default=DEFAULT_PROVIDERS, choices=list(PROVIDERS))
    ap.add_argument(
        "--profile", nargs="*", default=[],
        help="providers to profile in each mode, after timing it (a profiled process times "
        "later calls slower: take timings from a separate invocation)",
    )  # fmt: skip
    ap.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing on")
    ap.add_argument(
        "--dora-config",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="dora_torch.config values for this run, e.g. NORM_PASS_MAX_RANK=32",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench")
    args = ap.parse_args(argv)
    summary = bench(
        pathlib.Path(args.out),
        layers=args.layers,
        ranks=args.ranks,
        batches=args.batches,
        modes=args.modes,
        optims=args.optims,
        providers=args.providers,
        profile=args.profile,
        grad_ckpt=args.grad_ckpt,
        dora_config=dora_config_overrides(args.dora_config),
    )
    for row in summary:
        print(f"{row['metric']}: {row['value']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
