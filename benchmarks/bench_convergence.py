"""Convergence: ours vs PEFT's DoRA over many steps, same seed, same batches (the demo's loop).

The ``small`` demo config (8-layer Llama, hidden 512, byte vocabulary, DoRA r = 16 on all seven
projections) fine-tuned on the demo corpus in bf16 on the GPU, once with PEFT's DoRA (fp32
adapters, PEFT's default) and once with the same PEFT model accelerated by
``dora_torch.interop.accelerate_peft``. Reports the mean and max per-step |Δloss| (the DoRA
paper reports a mean of 7.1e-4 over 2000 steps) against the demo's bf16 thresholds, and the
median step times. Writes ``convergence.csv`` (per step) and ``convergence.png``.

Noise floor: PEFT's DoRA run a second time with cuBLAS's reduced-precision bf16 reductions
toggled (``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``), i.e. the same
model, data and seed with a different (equally valid) GEMM summation. Its per-step |Δloss|
against the first PEFT run is PEFT's own run-to-run spread; ours must stay within it
(mean and max, reported side by side).

Each of the three trainings (PEFT, ours, PEFT rerun) runs in its own process, all three at
once on the one GPU (``DORA_BENCH_CONV_PARALLEL=0`` runs them one after another in this
process). The small model leaves the GPU mostly idle (the step is host-bound), so 2000 steps
take about a third of the serial time; the losses do not depend on what else runs on the
device, but the step times do: they are reported only for serial runs.

    DORA_BENCH_CONV_STEPS=2000 python3 -m benchmarks.run --only convergence --skip-tests
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import replace

import numpy as np

PAPER_MEAN_DELTA = 7.1e-4


def steps() -> int:
    return int(os.environ.get("DORA_BENCH_CONV_STEPS", "2000"))


def run(out_dir: pathlib.Path) -> list[dict]:
    import torch

    from benchmarks.plots import line_plot
    from examples.configs import get_config
    from examples.demo import THRESHOLDS, delta_panel
    from examples.report import write_curves_csv

    if not torch.cuda.is_available():
        raise RuntimeError("bench_convergence needs a CUDA GPU")
    cfg = replace(get_config("small"), steps=steps())
    parallel = os.environ.get("DORA_BENCH_CONV_PARALLEL", "1") != "0"
    print(f"[convergence] config {cfg.name}, {cfg.steps} steps, bf16 on cuda, "
          f"{'three processes at once' if parallel else 'serial'}")  # fmt: skip
    out_dir = pathlib.Path(out_dir)
    if parallel:
        runs = _parallel_runs(cfg.steps, out_dir)
    else:
        runs = {kind: train_one(kind, cfg.steps) for kind in JOBS}
    peft, ours, rerun = (runs[kind] for kind in JOBS)
    delta = np.abs(np.asarray(peft.losses) - np.asarray(ours.losses))
    floor_losses = rerun.losses
    floor = np.abs(np.asarray(peft.losses) - np.asarray(floor_losses))

    curves = {
        "loss_peft": peft.losses,
        "loss_ours": ours.losses,
        "abs_delta": delta.tolist(),
        "loss_peft_rerun": floor_losses,
        "abs_delta_peft_rerun": floor.tolist(),
    }
    if not parallel:
        curves.update(ms_peft=peft.step_ms, ms_ours=ours.step_ms)
    write_curves_csv(out_dir / "convergence.csv", curves)
    x = list(range(1, cfg.steps + 1))
    line_plot(
        out_dir / "convergence.png",
        {
            "PEFT DoRA": (x, peft.losses),
            "ours (accelerate_peft)": (x, ours.losses),
            "PEFT DoRA, rerun (noise floor)": (x, floor_losses),
        },
        title=f"DoRA convergence, {cfg.name} Llama, bf16, mean |Δloss| {delta.mean():.2e}",
        xlabel="step",
        ylabel="training loss (nats/byte)",
        lower=delta_panel(x, delta),
        lower_ylabel="|Δloss|",
    )
    t = THRESHOLDS["bf16"]
    tag = f"{cfg.steps} steps bf16"
    return [
        dict(
            bench="convergence",
            metric=f"mean |Δloss| ({tag}; paper {PAPER_MEAN_DELTA})",
            value=float(delta.mean()),
            target=f"<= {t['loss_mean']}",
            ok=bool(delta.mean() <= t["loss_mean"]),
        ),
        dict(
            bench="convergence",
            metric=f"max |Δloss| ({tag})",
            value=float(delta.max()),
            target=f"<= {t['loss_max']}",
            ok=bool(delta.max() <= t["loss_max"]),
        ),
        dict(
            bench="convergence",
            metric=f"mean |Δloss| within PEFT's own floor ({floor.mean():.2e}, {tag})",
            value=float(delta.mean() / max(floor.mean(), 1e-30)),
            target="<= 1",
            ok=bool(delta.mean() <= floor.mean()),
        ),
        dict(
            bench="convergence",
            metric=f"max |Δloss| within PEFT's own floor ({floor.max():.2e}, {tag})",
            value=float(delta.max() / max(floor.max(), 1e-30)),
            target="<= 1",
            ok=bool(delta.max() <= floor.max()),
        ),
        dict(bench="convergence", metric="final loss PEFT DoRA", value=peft.losses[-1]),
        dict(bench="convergence", metric="final loss ours", value=ours.losses[-1]),
    ] + (
        []
        if parallel
        else [
            dict(
                bench="convergence",
                metric="step time PEFT/ours (median)",
                value=peft.median_step_ms / ours.median_step_ms,
            )
        ]
    )


#: The three trainings, in the order ``run`` reads them.
JOBS = ("peft", "ours", "peft_rerun")


def train_one(kind: str, n_steps: int):
    """One of ``JOBS`` from scratch: the demo's data, base and adapter init (seed 0), bf16."""
    import torch

    from examples.configs import get_config
    from examples.demo import stage_data
    from examples.training import OURS, build_base_model, peft_dora, train

    if kind not in JOBS:
        raise ValueError(f"kind must be one of {JOBS}; got {kind!r}")
    cfg = replace(get_config("small"), steps=n_steps)
    batches, _, tok = stage_data(cfg, seed=0)
    base = build_base_model(cfg, vocab_size=tok.vocab_size, seed=0)
    work = base.to(device="cuda", dtype=torch.bfloat16)
    model = peft_dora(work, cfg, seed=0)
    if kind == "ours":
        model = OURS["accelerate"].from_peft(model, work)
    flag = torch.backends.cuda.matmul
    before = flag.allow_bf16_reduced_precision_reduction
    if kind == "peft_rerun":  # the same GEMMs with the other (equally valid) bf16 summation
        flag.allow_bf16_reduced_precision_reduction = not before
    try:
        return train(model, batches, lr=cfg.lr, device="cuda", desc=kind)
    finally:
        flag.allow_bf16_reduced_precision_reduction = before


def _parallel_runs(n_steps: int, out_dir: pathlib.Path) -> dict:
    """``train_one`` for every job, each in its own process, all at once."""
    import json
    import subprocess
    import sys
    from types import SimpleNamespace

    out_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    for kind in JOBS:
        path = out_dir / f"convergence_{kind}.json"
        cmd = [sys.executable, "-m", "benchmarks.bench_convergence", kind, str(n_steps), str(path)]
        procs[kind] = (subprocess.Popen(cmd), path)
    failed = [kind for kind, (proc, _) in procs.items() if proc.wait() != 0]
    if failed:
        raise RuntimeError(f"convergence jobs failed: {failed}")
    runs = {}
    for kind, (_, path) in procs.items():
        runs[kind] = SimpleNamespace(**json.loads(path.read_text()))
        path.unlink()
    return runs


def main(argv=None) -> int:
    """``python -m benchmarks.bench_convergence KIND STEPS OUT.json``: one job (see ``run``)."""
    import json
    import sys

    kind, n_steps, path = argv if argv is not None else sys.argv[1:]
    result = train_one(kind, int(n_steps))
    pathlib.Path(path).write_text(json.dumps({"losses": result.losses}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
