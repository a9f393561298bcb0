"""`make demo`: fine-tune a small Llama with PEFT's DoRA and with ours, then check they agree.

    python -m examples.demo [--device cpu|cuda] [--config tiny|small|base] [--steps N]
                            [--dtype fp32|bf16] [--ours inject|accelerate] [--out out/demo]
                            [--seed 0] [--skip-jax]

Stages (each a function below):
  1. data: a public-domain corpus shipped in examples/data/, byte-tokenised (nothing downloaded);
  2. model: a transformers LlamaForCausalLM from a config, random weights, fixed seed;
  3. train: DoRA (r, alpha from the config) on all seven projections, twice from the same
     initial adapter and the same batches — PEFT's DoRA, and ours — recording loss, time per
     step and peak memory. Ours is ``--ours inject`` (default: PEFT's initial adapter file read
     by ``dora_torch.interop.load_adapter`` into the plain model, no PEFT at run time) or
     ``--ours accelerate`` (``dora_torch.interop.accelerate_peft`` on a copy of PEFT's model);
  4. interop: save our adapter in PEFT's format (``save_adapter``, or ``save_pretrained`` for
     the accelerated PEFT model); load it with ``PeftModel.from_pretrained`` and, with
     ``dora_jax.load_adapter``, into the Flax nnx Llama twin; compare logits on
     held-out text;
  5. report: out/demo/results.csv (summary), out/demo/loss.csv (per step), out/demo/loss.png.

Exits 1 if a parity check fails. Checks and thresholds (``THRESHOLDS``):
  - mean and max per-step |loss_PEFT − loss_ours|: fp32 ≤ 1e-4 / 1e-3; bf16 ≤ 2e-3 / 2e-2
    (the DoRA paper reports a mean of 7.1e-4 over 2000 bf16 steps);
  - worst per-token logit cosine, PEFT reload of our file vs our model: fp32 ≥ 0.99999,
    bf16 ≥ 0.999;
  - worst per-token logit cosine, dora_jax twin vs ours (both fp32, CPU): ≥ 0.99999.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch

from .configs import CONFIGS, RunConfig, get_config
from .corpus import EVAL_FILE, TRAIN_FILE, ByteTokenizer, load_text, sample_batches
from .parity import jax_twin_logits, min_cosine, peft_reload
from .report import Row, format_table, write_curves_csv, write_results_csv
from .training import OURS, TrainResult, build_base_model, peft_dora, torch_logits, train

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (mean |Δloss|, max |Δloss|, min logit cosine) per training dtype; the JAX twin check always
# runs in fp32 and uses the fp32 cosine.
THRESHOLDS = {
    "fp32": {"loss_mean": 1e-4, "loss_max": 1e-3, "cosine": 0.99999},
    "bf16": {"loss_mean": 2e-3, "loss_max": 2e-2, "cosine": 0.999},
}
EVAL_SEQUENCES = 4  # held-out windows for the logit comparisons


@dataclass
class PairResult:
    """What the two fine-tuning runs leave behind."""

    peft: TrainResult
    ours: TrainResult
    peft_model: object
    ours_model: object


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    config_steps = ", ".join(f"{name}: {cfg.steps}" for name, cfg in CONFIGS.items())
    ap.add_argument(
        "--device", default="cpu", help="torch device, cpu or cuda (default: %(default)s)"
    )
    ap.add_argument(
        "--config",
        default="tiny",
        choices=list(CONFIGS),
        help="model/run size (default: %(default)s)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps (default: the config's; {config_steps})",
    )
    ap.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="base model dtype (default: fp32 on cpu, bf16 on cuda)",
    )
    ap.add_argument(
        "--ours",
        choices=sorted(OURS),
        default="inject",
        help="how ours is built: inject dora_torch.Linear, or accelerate_peft "
        "(default: %(default)s)",
    )
    ap.add_argument("--out", default="out/demo", help="output directory (default: %(default)s)")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed: base weights, adapters, batches (default: %(default)s)",
    )
    ap.add_argument(
        "--skip-jax",
        action="store_true",
        help="skip the dora_jax twin check (default: %(default)s, i.e. run it)",
    )
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bf16" if torch.device(args.device).type == "cuda" else "fp32"
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be at least 1; got {args.steps}")
    return args


def stage_data(cfg: RunConfig, *, seed: int) -> tuple[np.ndarray, np.ndarray, ByteTokenizer]:
    """Training batches int64 [steps, batch, seq_len + 1] and held-out ids [n, seq_len]."""
    tok = ByteTokenizer()
    train_ids = tok.encode(load_text(TRAIN_FILE))
    batches = sample_batches(
        train_ids, batch_size=cfg.batch_size, seq_len=cfg.seq_len, steps=cfg.steps, seed=seed
    )
    held_out = tok.encode(load_text(EVAL_FILE))
    n = min(EVAL_SEQUENCES, len(held_out) // cfg.seq_len)
    eval_ids = held_out[: n * cfg.seq_len].reshape(n, cfg.seq_len)
    return batches, eval_ids, tok


def stage_train(
    base, cfg: RunConfig, batches: np.ndarray, *, device, dtype, seed: int, ours
) -> PairResult:
    """Fine-tune PEFT's DoRA and ours from identical starting points on the same batches.

    ``base`` stays untouched (fp32, CPU); both runs use a copy on ``device`` in ``dtype``.
    ``ours`` (one of ``training.OURS``) builds our model from the fresh PEFT model.
    """
    work = copy.deepcopy(base).to(device=device, dtype=dtype)
    peft_model = peft_dora(work, cfg, seed=seed)
    ours_model = ours.from_peft(peft_model, work)
    del work
    peft_res = train(peft_model, batches, lr=cfg.lr, device=device, desc="PEFT DoRA")
    ours_res = train(ours_model, batches, lr=cfg.lr, device=device, desc="ours     ")
    return PairResult(peft_res, ours_res, peft_model, ours_model)


def stage_interop(
    base, pair: PairResult, eval_ids, out: pathlib.Path, *, ours, device, dtype, jax: bool
) -> dict[str, float]:
    """Save ours in PEFT's format; reload it with PEFT (training device/dtype) and with
    dora_jax into the nnx twin (fp32, CPU); return the worst per-token logit cosines."""
    adapter_dir = out / "adapter"
    ours.save(pair.ours_model, adapter_dir)
    ours_logits = torch_logits(pair.ours_model, eval_ids, device=device)
    peft_logits = torch_logits(pair.peft_model, eval_ids, device=device)
    reloaded = peft_reload(base, adapter_dir, device=device, dtype=dtype)
    result = {
        "trained_models": min_cosine(peft_logits, ours_logits),
        "peft_reload": min_cosine(torch_logits(reloaded, eval_ids, device=device), ours_logits),
    }
    if jax:
        # Both sides in fp32 on the CPU: the check is about the file and the twin, not dtypes.
        want = torch_logits(ours.load(base, adapter_dir), eval_ids, device="cpu")
        got = jax_twin_logits(base.config, base.state_dict(), adapter_dir, eval_ids)
        result["jax_twin"] = min_cosine(got, want)
    return result


def summary_rows(pair: PairResult, cosines: dict[str, float], *, dtype_name: str) -> list[Row]:
    """The results table: per-provider numbers, then the checks."""
    t = THRESHOLDS[dtype_name]
    p, o = pair.peft, pair.ours
    delta = np.abs(np.asarray(p.losses) - np.asarray(o.losses))
    mib = 2.0**20
    rows = [
        Row("loss, first step", p.losses[0], o.losses[0]),
        Row("loss, last step", p.losses[-1], o.losses[-1]),
        Row(
            "time per step, median (ms); value = ours/PEFT",
            p.median_step_ms,
            o.median_step_ms,
            o.median_step_ms / p.median_step_ms,
        ),
        Row(
            f"peak memory (MiB, {p.memory_kind}); value = ours/PEFT",
            p.peak_bytes / mib,
            o.peak_bytes / mib,
            o.peak_bytes / max(p.peak_bytes, 1),
        ),
        Row(
            "logit cosine, PEFT-trained vs ours-trained (min/token)",
            value=cosines["trained_models"],
        ),
        Row(
            "mean |loss_PEFT - loss_ours| per step", value=float(delta.mean()), limit=t["loss_mean"]
        ),
        Row("max |loss_PEFT - loss_ours| per step", value=float(delta.max()), limit=t["loss_max"]),
        Row(
            "logit cosine, PEFT from_pretrained(our file) vs ours (min/token)",
            value=cosines["peft_reload"],
            limit=t["cosine"],
            at_least=True,
        ),
    ]
    if "jax_twin" in cosines:
        rows.append(
            Row(
                "logit cosine, dora_jax twin (our file) vs ours, fp32 (min/token)",
                value=cosines["jax_twin"],
                limit=THRESHOLDS["fp32"]["cosine"],
                at_least=True,
            )
        )
    return rows


def delta_panel(steps, delta: np.ndarray):
    if not np.any(delta > 0):
        return None
    return {
        "|loss_PEFT - loss_ours| (zeros not drawn)": (steps, np.where(delta > 0, delta, np.nan))
    }


def stage_report(
    pair: PairResult, rows: list[Row], out: pathlib.Path, *, title: str, ours_label: str = "ours"
) -> str:
    """Write results.csv, loss.csv and loss.png under ``out``; return the printed table."""
    from benchmarks.plots import line_plot

    write_results_csv(out / "results.csv", rows)
    write_curves_csv(
        out / "loss.csv",
        {
            "loss_peft": pair.peft.losses,
            "loss_ours": pair.ours.losses,
            "ms_peft": pair.peft.step_ms,
            "ms_ours": pair.ours.step_ms,
        },
    )
    steps = list(range(1, len(pair.peft.losses) + 1))
    delta = np.abs(np.asarray(pair.peft.losses) - np.asarray(pair.ours.losses))
    drew = line_plot(
        out / "loss.png",
        {
            "PEFT DoRA": (steps, pair.peft.losses),
            ours_label: (steps, pair.ours.losses),
        },
        title=title,
        xlabel="step",
        ylabel="training loss (nats/byte)",
        # log axis: steps with identical losses (Δ = 0) are left out, not drawn at a fake floor
        lower=delta_panel(steps, delta),
        lower_ylabel="|Δloss|",
    )
    note = "" if drew else "\n(matplotlib not installed: loss.png not written; loss.csv has it)"
    return format_table(rows) + note


def main(argv=None) -> int:
    args = parse_args(argv)
    # transformers 5 deprecates an attribute PEFT 0.21 still reads: noise, not news, here
    warnings.filterwarnings(
        "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
    )
    cfg = get_config(args.config)
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    device, dtype, ours = torch.device(args.device), DTYPES[args.dtype], OURS[args.ours]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    batches, eval_ids, tok = stage_data(cfg, seed=args.seed)
    base = build_base_model(cfg, vocab_size=tok.vocab_size, seed=args.seed)
    n_params = sum(p.numel() for p in base.parameters())
    print(
        f"DoRA demo: config {cfg.name} ({n_params / 1e6:.2f}M params, {cfg.layers} layers, "
        f"hidden {cfg.hidden}), r={cfg.rank}, alpha={cfg.alpha}, {cfg.steps} steps of "
        f"{cfg.batch_size}x{cfg.seq_len} bytes, {args.dtype} on {device}; ours = {ours.name}",
        flush=True,
    )
    pair = stage_train(base, cfg, batches, device=device, dtype=dtype, seed=args.seed, ours=ours)
    cosines = stage_interop(
        base, pair, eval_ids, out, ours=ours, device=device, dtype=dtype, jax=not args.skip_jax
    )
    rows = summary_rows(pair, cosines, dtype_name=args.dtype)
    title = f"DoRA fine-tuning, {cfg.name} Llama, {args.dtype} on {device.type}"
    report = stage_report(pair, rows, out, title=title, ours_label=f"ours ({ours.name})")
    print("\n" + report)
    failed = [r.metric for r in rows if r.ok is False]
    print(f"\nwrote {out}/results.csv, loss.csv, loss.png, adapter/")
    if failed:
        print("PARITY CHECK FAILED: " + "; ".join(failed), file=sys.stderr)
        return 1
    print("all parity checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
