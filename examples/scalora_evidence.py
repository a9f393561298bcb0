"""Does ScaLoRA help here? LoRA, ScaLoRA, ScaLoRA-I, DoRA and DoRA+ScaLoRA on the demo's Llama.

    python -m examples.scalora_evidence [--config tiny] [--steps N] [--lrs 1e-3,3e-3,1e-2]
        [--methods lora,scalora,scalora_i,dora,dora_scalora] [--interval 10]
        [--lr-times-L auto] [--holdout 0.1] [--eval-every 25] [--eval-windows 64]
        [--rank-rtol 1e-3] [--seed 0] [--threads 1] [--pretrain-steps 0] [--pretrain-lr 3e-3]
        [--out benchmarks/results/scalora_evidence]

Setup (the demo's, ``examples/demo.py``): a transformers ``LlamaForCausalLM`` built from a
named config (``examples/configs.py``; random weights, fixed seed, fp32, CPU), byte-tokenised
public-domain text shipped in ``examples/data/`` (nothing is downloaded). The training file is
split: its last ``--holdout`` fraction is held out (never trained on); training windows are
sampled from the rest, the same batches for every run. Adapters go on all seven projections
with the config's r and alpha, as PEFT models (``get_peft_model``):

    lora          PEFT LoRA
    scalora       PEFT LoRA + ``dora_torch.ScaLoRA`` (interval 1: rescale and merge every step)
    scalora_i     PEFT LoRA + ScaLoRA-I (``--interval``, default 10)
    dora          PEFT DoRA accelerated by ``dora_torch.accelerate_peft``
    dora_scalora  accelerated PEFT DoRA + ScaLoRA (interval 1)

ScaLoRA is registered on the optimizer (``ScaLoRA(model, opt, ...).register()``: it runs
before every ``opt.step()``) with ``--lr-times-L`` (default ``auto``: the torch class's
default rule, see dora_torch/scalora.py; a number is L·η in project units). Every run uses
AdamW (weight decay 0) with the same learning-rate grid ``--lrs``; each method's best lr is
the one with the lowest final held-out loss (non-finite counts as worst). Nothing is tuned per
method beyond that grid.

A random base is not what the paper fine-tunes: ``--pretrain-steps N`` first trains the
whole base (every parameter, AdamW at ``--pretrain-lr``, weight decay 0) for N steps on the
first half of the training part, and the adapters are then trained on the second half, text
the base has not seen; the held-out slice is the same. The log records the base's held-out
loss before and after pretraining. N = 0 (the default) is the random-base experiment.

Measured per run: ``final_train_loss`` = mean training loss of the last 10 steps (one step's
batch loss is noisy); ``heldout_loss`` = mean next-byte cross-entropy (nats/byte) over up to
``--eval-windows`` evenly spaced, non-overlapping windows of the held-out slice after the last
step (also every ``--eval-every`` steps, for the plot); ``train_s`` = summed wall time of the
training steps (forward, backward, ScaLoRA, AdamW; evaluation excluded); ``ms_per_step`` =
their median. Rank of the accumulated update: per adapted layer, ΔW = W_T − W_0 with W the
effective weight W_base + s·lora_B·lora_A (for DoRA this is the direction matrix V that the
magnitude rescales per row; the magnitude is not included), in float64, and its numerical rank
#{σ_i > rtol·σ_1} with rtol = ``--rank-rtol`` (default 1e-3); reported as mean/min/max over
layers, with the mean rank at 10·rtol and the mean stable rank ‖ΔW‖_F²/σ_1² (threshold-free),
since the spectrum of a ScaLoRA update decays gradually and its numerical rank depends on the
threshold. The default rtol is far above the fp32 rounding that ScaLoRA's in-place merges
leave in W_base (on ``tiny``, ScaLoRA lr 1e-3: at most 5e-6·σ_1, median 3e-7·σ_1, measured
against a float64 replay of the same merges). LoRA's ΔW = s·B_T·A_T has rank ≤ r by
construction; ScaLoRA merges s·B diag(1 − α⊙β) A into W_base at every merge, so its ΔW is a
sum of many rank-r terms. ``lora_A_norm_mean`` / ``lora_B_norm_mean``: mean Frobenius norm of
the factors after the last step (ScaLoRA rescales them; AdamW's step size is not rescaled).
A run whose loss turns non-finite stops there (``status`` diverged, no held-out loss, no rank).
For ScaLoRA runs, ``column_frac`` is the fraction of layer merges that took Theorem 5's column
branch (the rest: scalar fallback or no-op).

Cost: the default (``tiny``, 200 steps, 5 methods × 3 lrs) takes about 7 minutes on one CPU
thread (``--threads 1``, the default: on a shared 2-core machine two threads spin-wait and a
step can take 50× longer under contention).

Outputs (``--out`` is a path prefix): ``<out>.csv`` (one row per method and lr, ``best``
marks each method's pick), ``<out>.curves.csv`` (per-step training loss and held-out
evaluations of every run), ``<out>.png`` (loss curves of each method's best lr; needs
matplotlib) and ``<out>.log`` (command, date, config, settings and the tables).
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime
import math
import pathlib
import platform
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from .configs import CONFIGS, TARGET_MODULES, RunConfig, get_config
from .corpus import TRAIN_FILE, ByteTokenizer, load_text, sample_batches
from .training import build_base_model


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    dora: bool
    interval: int | None  # ScaLoRA interval; None: no ScaLoRA


def methods(interval: int) -> dict[str, Method]:
    return {
        m.key: m
        for m in (
            Method("lora", "LoRA", False, None),
            Method("scalora", "ScaLoRA", False, 1),
            Method("scalora_i", f"ScaLoRA-I (I={interval})", False, interval),
            Method("dora", "DoRA", True, None),
            Method("dora_scalora", "DoRA+ScaLoRA", True, 1),
        )
    }


METHOD_KEYS = tuple(methods(10))
DEFAULT_LRS = (1e-3, 3e-3, 1e-2)
FINAL_TRAIN_STEPS = 10  # final_train_loss averages this many last steps
EVAL_BATCH = 16  # held-out windows per forward pass


@dataclass
class RunResult:
    method: str
    label: str
    lr: float
    r: int
    steps: int = 0
    train_losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss)
    train_s: float = 0.0
    ms_per_step: float = math.nan
    ranks: list[int] = field(default_factory=list)  # per layer at rtol; [] if ΔW not finite
    ranks_coarse: list[int] = field(default_factory=list)  # per layer at 10·rtol
    stable_ranks: list[float] = field(default_factory=list)
    layers: int = 0
    norm_A: float = math.nan  # mean over layers of ‖lora_A‖_F after the last step
    norm_B: float = math.nan  # the same for lora_B
    merges: int = 0
    branch_counts: dict[str, int] = field(default_factory=dict)
    diverged: bool = False
    best: bool = False

    @property
    def final_train_loss(self) -> float:
        tail = self.train_losses[-FINAL_TRAIN_STEPS:]
        return float(np.mean(tail)) if tail else math.nan

    @property
    def heldout_loss(self) -> float:
        return self.evals[-1][1] if self.evals else math.nan

    @property
    def column_frac(self) -> float:
        total = sum(self.branch_counts.values())
        return self.branch_counts.get("column", 0) / total if total else math.nan

    def rank_summary(self) -> str:
        if not self.ranks:
            return "n/a (not finite)"
        return f"{np.mean(self.ranks):.1f} [{min(self.ranks)}, {max(self.ranks)}]"

    def row(self, rank_rtol: float) -> dict:
        def num(v, fmt):
            return "" if v is None or not math.isfinite(v) else format(v, fmt)

        rk, rc, sr = self.ranks, self.ranks_coarse, self.stable_ranks
        return {
            "method": self.method,
            "label": self.label,
            "lr": f"{self.lr:g}",
            "best": str(self.best).lower(),
            "status": "diverged" if self.diverged else "ok",
            "final_train_loss": num(self.final_train_loss, ".5f"),
            "heldout_loss": num(self.heldout_loss, ".5f"),
            "steps": self.steps,
            "train_s": num(self.train_s, ".1f"),
            "ms_per_step": num(self.ms_per_step, ".1f"),
            "r": self.r,
            "rank_rtol": f"{rank_rtol:g}",
            "rank_mean": num(float(np.mean(rk)), ".2f") if rk else "",
            "rank_min": min(rk) if rk else "",
            "rank_max": max(rk) if rk else "",
            "rank_mean_10x_rtol": num(float(np.mean(rc)), ".2f") if rc else "",
            "stable_rank_mean": num(float(np.mean(sr)), ".3f") if sr else "",
            "layers": self.layers,
            "lora_A_norm_mean": num(self.norm_A, ".4g"),
            "lora_B_norm_mean": num(self.norm_B, ".4g"),
            "merges": self.merges,
            "column_frac": num(self.column_frac, ".3f"),
        }


CSV_FIELDS = tuple(RunResult("", "", 0.0, 0).row(1e-3).keys())


# ---- data and models ---------------------------------------------------------------------


def split_corpus(holdout: float) -> tuple[np.ndarray, np.ndarray]:
    """Byte ids of the training file: (train part, held-out last ``holdout`` fraction)."""
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be in (0, 1); got {holdout}")
    ids = ByteTokenizer().encode(load_text(TRAIN_FILE))
    cut = round(len(ids) * (1.0 - holdout))
    return ids[:cut], ids[cut:]


def heldout_windows(ids: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Up to ``max_windows`` evenly spaced non-overlapping windows [n, seq_len + 1]."""
    n = len(ids) // (seq_len + 1)
    if n < 1:
        raise ValueError(f"held-out slice has {len(ids)} tokens; need at least {seq_len + 1}")
    pick = np.unique(np.linspace(0, n - 1, min(n, max_windows)).round().astype(int))
    return np.stack([ids[i * (seq_len + 1) : (i + 1) * (seq_len + 1)] for i in pick])


def pretrain(base, cfg: RunConfig, ids: np.ndarray, *, steps: int, lr: float, seed: int):
    """Train every parameter of ``base`` in place for ``steps`` AdamW steps (weight decay 0) on
    windows of ``ids``; returns the mean loss of the last ``FINAL_TRAIN_STEPS`` steps."""
    batches = sample_batches(
        ids, batch_size=cfg.batch_size, seq_len=cfg.seq_len, steps=steps, seed=seed
    )
    base.train()
    opt = torch.optim.AdamW(base.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for batch in batches:
        ids_t = torch.as_tensor(batch)
        loss = base(input_ids=ids_t, labels=ids_t).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"pretraining diverged at step {len(losses)} (lr {lr:g})")
    base.eval()
    return float(np.mean(losses[-FINAL_TRAIN_STEPS:]))


def build_model(base, cfg: RunConfig, method: Method, *, seed: int):
    """PEFT LoRA or DoRA (accelerated by dora_torch) on a deep copy of ``base``; the adapter's
    random init depends only on ``seed`` (PEFT draws lora_A from torch's global RNG)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        use_dora=method.dora,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
    )
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), config)
    if method.dora:
        from dora_torch import accelerate_peft

        model = accelerate_peft(model)
    return model


@torch.no_grad()
def heldout_loss(model, windows: np.ndarray) -> float:
    """Mean next-token cross-entropy over the windows (each window's tokens weigh equally)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(windows), EVAL_BATCH):
        ids = torch.as_tensor(windows[i : i + EVAL_BATCH])
        total += float(model(input_ids=ids, labels=ids).loss) * len(ids)
    model.train(was_training)
    return total / len(windows)


@torch.no_grad()
def effective_weights(adapters) -> dict[str, torch.Tensor]:
    """W_base + s·lora_B·lora_A per adapter, float64 [d_out, d_in]."""
    f64 = torch.float64
    return {
        a.name: a.base.to(f64) + a.scaling * (a.lora_B.to(f64) @ a.lora_A.to(f64)) for a in adapters
    }


def update_ranks(w0: dict, w1: dict, rtol: float):
    """Per layer, for ΔW = W_1 − W_0: numerical ranks #{σ_i > t·σ_1} at t = rtol and 10·rtol,
    and the stable rank ‖ΔW‖_F²/σ_1². Returns three lists, all empty if any ΔW is not finite
    (a diverged run)."""
    ranks, coarse, stable = [], [], []
    for name, a in w0.items():
        d = w1[name] - a
        if not bool(torch.isfinite(d).all()):
            return [], [], []
        s = torch.linalg.svdvals(d)
        top = float(s[0]) if len(s) else 0.0
        if top == 0.0:
            ranks.append(0)
            coarse.append(0)
            stable.append(0.0)
            continue
        ranks.append(int((s > rtol * top).sum()))
        coarse.append(int((s > 10 * rtol * top).sum()))
        stable.append(float((s * s).sum()) / (top * top))
    return ranks, coarse, stable


# ---- one run -----------------------------------------------------------------------------


def run_one(base, cfg, method: Method, lr: float, batches, windows, args) -> RunResult:
    from dora_torch import ScaLoRA
    from dora_torch.scalora import find_adapters

    model = build_model(base, cfg, method, seed=args.seed)
    adapters = find_adapters(model)
    w0 = effective_weights(adapters)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sc = None
    if method.interval is not None:
        sc = ScaLoRA(model, opt, lr_times_L=args.lr_times_L, interval=method.interval)
        sc.register()
    res = RunResult(method.key, method.label, lr, cfg.rank, layers=len(adapters))
    res.evals.append((0, heldout_loss(model, windows)))
    model.train()
    step_s = []
    for i in range(len(batches)):
        t0 = time.perf_counter()
        ids = torch.as_tensor(batches[i])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        step_s.append(time.perf_counter() - t0)
        res.train_losses.append(value)
        res.steps = i + 1
        if sc is not None and sc.last_report is not None and sc.last_report.merged:
            res.merges += 1
            for k, n in sc.last_report.counts().items():
                res.branch_counts[k] = res.branch_counts.get(k, 0) + n
        if not math.isfinite(value):
            print(f"  {method.label} lr={lr:g}: non-finite loss at step {i + 1}; stopping")
            res.evals.append((i + 1, math.nan))
            res.diverged = True
            break
        if (i + 1) % args.eval_every == 0 or i + 1 == len(batches):
            res.evals.append((i + 1, heldout_loss(model, windows)))
    res.train_s = float(sum(step_s))
    res.ms_per_step = float(np.median(step_s) * 1e3) if step_s else math.nan
    w1 = effective_weights(adapters)
    res.ranks, res.ranks_coarse, res.stable_ranks = update_ranks(w0, w1, args.rank_rtol)
    with torch.no_grad():
        res.norm_A = float(np.mean([float(a.lora_A.double().norm()) for a in adapters]))
        res.norm_B = float(np.mean([float(a.lora_B.double().norm()) for a in adapters]))
    return res


def pick_best(results: list[RunResult]) -> None:
    """Mark each method's run with the lowest finite final held-out loss."""
    by_method: dict[str, list[RunResult]] = {}
    for r in results:
        by_method.setdefault(r.method, []).append(r)
    for runs in by_method.values():
        finite = [r for r in runs if math.isfinite(r.heldout_loss)]
        if finite:
            min(finite, key=lambda r: r.heldout_loss).best = True


# ---- outputs -----------------------------------------------------------------------------


def format_table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    head = [h for _, h in cols]
    body = [[str(row[k]) for k, _ in cols] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *map(line, body)])


TABLE_COLS = [
    ("label", "method"),
    ("lr", "lr"),
    ("final_train_loss", "train loss (last 10)"),
    ("heldout_loss", "held-out loss"),
    ("steps", "steps"),
    ("status", "status"),
    ("train_s", "train s"),
    ("ms_per_step", "ms/step"),
    ("rank_mean", "rank ΔW mean"),
    ("rank_min", "min"),
    ("rank_max", "max"),
    ("rank_mean_10x_rtol", "mean @10x rtol"),
    ("stable_rank_mean", "stable rank"),
    ("lora_A_norm_mean", "|A|"),
    ("lora_B_norm_mean", "|B|"),
    ("column_frac", "column frac"),
]


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_FIELDS))
        w.writeheader()
        w.writerows(rows)


def write_curves(path: pathlib.Path, results: list[RunResult]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "lr", "kind", "step", "loss"])
        for r in results:
            for i, v in enumerate(r.train_losses, start=1):
                w.writerow([r.method, f"{r.lr:g}", "train", i, f"{v:.6f}"])
            for step, v in r.evals:
                w.writerow([r.method, f"{r.lr:g}", "heldout", step, f"{v:.6f}"])


def smooth(y, k: int) -> np.ndarray:
    """Trailing mean over ``k`` steps (fewer at the start)."""
    y = np.asarray(y, dtype=np.float64)
    c = np.cumsum(np.insert(y, 0, 0.0))
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(0, i - k)
    return (c[i] - c[lo]) / (i - lo)


def write_plot(path: pathlib.Path, best: list[RunResult], title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, low) = plt.subplots(2, 1, figsize=(8, 7), dpi=120, sharex=True)
    styles = ["-", "--", "-.", ":", (0, (5, 1))]
    for i, r in enumerate(best):
        lab = f"{r.label}, lr={r.lr:g}"
        steps = np.arange(1, len(r.train_losses) + 1)
        k = max(1, min(10, len(steps) // 10))
        top.plot(steps, smooth(r.train_losses, k), linestyle=styles[i % 5], label=lab, lw=1.4)
        es, ev = zip(*r.evals)
        low.plot(es, ev, linestyle=styles[i % 5], marker="o", markersize=3, label=lab, lw=1.4)
    top.set(title=title, ylabel="train loss (nats/byte, 10-step mean)")
    low.set(xlabel="step", ylabel="held-out loss (nats/byte)")
    for ax in (top, low):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    # the first steps dominate the range: show the part where the methods differ
    tail = [v for r in best for v in r.train_losses[len(r.train_losses) // 5 :]]
    tail_e = [v for r in best for _, v in r.evals[1:]]
    if tail and all(map(math.isfinite, tail)):
        top.set_ylim(min(tail) - 0.05, max(tail) + 0.1)
    if tail_e and all(map(math.isfinite, tail_e)):
        low.set_ylim(min(tail_e) - 0.05, max(tail_e) + 0.1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ---- command line ------------------------------------------------------------------------


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers; got {text!r}") from e
    if not vals or not all(math.isfinite(v) and v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers; got {text!r}")
    return vals


def _methods(text: str) -> tuple[str, ...]:
    keys = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [k for k in keys if k not in METHOD_KEYS]
    if bad or not keys:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad}; choose from {METHOD_KEYS}")
    return keys


def _lr_times_L(text: str) -> float | None:
    if text == "auto":
        return None
    (v,) = _floats(text)
    return v


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--config", default="tiny", choices=list(CONFIGS), help="model/run size")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: config's)")
    ap.add_argument(
        "--lrs", type=_floats, default=DEFAULT_LRS, help="AdamW learning-rate grid, comma-sep."
    )
    ap.add_argument("--methods", type=_methods, default=METHOD_KEYS, help="comma-separated")
    ap.add_argument("--interval", type=int, default=10, help="ScaLoRA-I's merge interval")
    ap.add_argument(
        "--lr-times-L",
        type=_lr_times_L,
        default=None,
        help="ScaLoRA's L·eta: 'auto' (None; the class default) or a number (project units)",
    )
    ap.add_argument("--holdout", type=float, default=0.1, help="held-out tail of the corpus")
    ap.add_argument("--eval-every", type=int, default=25, help="held-out eval period (steps)")
    ap.add_argument("--eval-windows", type=int, default=64, help="max held-out windows")
    ap.add_argument("--rank-rtol", type=float, default=1e-3, help="numerical-rank threshold")
    ap.add_argument("--seed", type=int, default=0, help="base weights, adapters, batches")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: on a shared 2-core machine, 2 threads spin-wait and a step "
        "can take 50x longer under contention; these models are too small to gain from 2)",
    )
    ap.add_argument(
        "--pretrain-steps",
        type=int,
        default=0,
        help="train the whole base this many steps on the first half of the training part "
        "first; the adapters then train on the second half (0: a random base, all of it)",
    )
    ap.add_argument("--pretrain-lr", type=float, default=3e-3, help="AdamW lr of pretraining")
    ap.add_argument(
        "--out",
        default="benchmarks/results/scalora_evidence",
        help="output path prefix (.csv, .curves.csv, .png, .log)",
    )
    args = ap.parse_args(argv)
    for name in ("steps", "interval", "eval_every", "eval_windows", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1; got {v}")
    if not 0.0 < args.rank_rtol < 1.0:
        ap.error(f"--rank-rtol must be in (0, 1); got {args.rank_rtol}")
    if args.pretrain_steps < 0:
        ap.error(f"--pretrain-steps must be at least 0; got {args.pretrain_steps}")
    if not (math.isfinite(args.pretrain_lr) and args.pretrain_lr > 0):
        ap.error(f"--pretrain-lr must be a positive number; got {args.pretrain_lr}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    cfg = get_config(args.config)
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.UTC)

    train_ids, held_ids = split_corpus(args.holdout)
    windows = heldout_windows(held_ids, cfg.seq_len, args.eval_windows)
    base = build_base_model(cfg, vocab_size=ByteTokenizer().vocab_size, seed=args.seed)
    pretrained = ""
    if args.pretrain_steps:
        half = len(train_ids) // 2
        pre_ids, train_ids = train_ids[:half], train_ids[half:]
        before = heldout_loss(base, windows)
        t0 = time.perf_counter()
        pre_loss = pretrain(base, cfg, pre_ids, steps=args.pretrain_steps, lr=args.pretrain_lr,
                            seed=args.seed + 1)  # fmt: skip
        pretrained = (
            f"base pretrained {args.pretrain_steps} steps (lr {args.pretrain_lr:g}) on the first "
            f"{len(pre_ids)} training bytes in {time.perf_counter() - t0:.0f} s: train loss "
            f"{pre_loss:.4f}, held-out loss {before:.4f} -> {heldout_loss(base, windows):.4f}; "
            f"adapters train on the other {len(train_ids)} bytes"
        )
        print(pretrained, flush=True)
    batches = sample_batches(
        train_ids, batch_size=cfg.batch_size, seq_len=cfg.seq_len, steps=cfg.steps, seed=args.seed
    )
    table = methods(args.interval)
    chosen = [table[k] for k in args.methods]
    n_params = sum(p.numel() for p in base.parameters())
    lrt = "auto" if args.lr_times_L is None else f"{args.lr_times_L:g}"
    header = (
        f"ScaLoRA evidence: config {cfg.name} ({n_params / 1e6:.2f}M params), r={cfg.rank}, "
        f"alpha={cfg.alpha}, {cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} bytes; "
        f"train {len(train_ids)} / held-out {len(held_ids)} bytes ({len(windows)} windows); "
        f"lrs {[f'{x:g}' for x in args.lrs]}; ScaLoRA lr_times_L={lrt}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(header, flush=True)

    results = []
    t_all = time.perf_counter()
    for m in chosen:
        for lr in args.lrs:
            t0 = time.perf_counter()
            r = run_one(base, cfg, m, lr, batches, windows, args)
            results.append(r)
            print(
                f"  {m.label:<20} lr={lr:<8g} train {r.final_train_loss:.4f}  held-out "
                f"{r.heldout_loss:.4f}  rank ΔW {r.rank_summary()}  "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
    total_s = time.perf_counter() - t_all
    pick_best(results)

    rows = [r.row(args.rank_rtol) for r in results]
    best = [r for r in results if r.best]
    best_rows = [r.row(args.rank_rtol) for r in best]
    csv_path, curves_path, png_path, log_path = (
        pathlib.Path(f"{out}{ext}") for ext in (".csv", ".curves.csv", ".png", ".log")
    )
    write_csv(csv_path, rows)
    write_curves(curves_path, results)
    title = f"{cfg.name} Llama, r={cfg.rank}, {cfg.steps} steps: each method's best lr"
    if args.pretrain_steps:
        title += f" (base pretrained {args.pretrain_steps} steps)"
    drew = write_plot(png_path, best, title)

    best_table = format_table(best_rows, TABLE_COLS)
    grid_table = format_table(rows, TABLE_COLS)
    lines = [
        f"command: python -m examples.scalora_evidence {' '.join(argv)}".rstrip(),
        f"date: {started.isoformat(timespec='seconds')}",
        f"host: {platform.machine()} {platform.system()}, {torch.get_num_threads()} torch "
        f"threads; python {platform.python_version()}; torch {torch.__version__}",
        f"config: {asdict(cfg)}",
        f"settings: methods={list(args.methods)} lrs={list(args.lrs)} interval={args.interval} "
        f"lr_times_L={lrt} holdout={args.holdout} eval_every={args.eval_every} "
        f"eval_windows={len(windows)} rank_rtol={args.rank_rtol:g} seed={args.seed} "
        f"pretrain_steps={args.pretrain_steps} pretrain_lr={args.pretrain_lr:g}",
        header,
        *([pretrained] if pretrained else []),
        f"total time {total_s:.0f} s",
        "",
        "Best lr per method (lowest final held-out loss):",
        best_table,
        "",
        "All runs:",
        grid_table,
    ]
    lora = next((r for r in best if r.method == "lora"), None)
    others = [r for r in best if r is not lora]
    if lora is not None and others:
        lines += ["", "Held-out loss of each best run minus LoRA's best (negative = better):"]
        lines += [f"  {r.label}: {r.heldout_loss - lora.heldout_loss:+.4f}" for r in others]
    log_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n" + "\n".join(lines[lines.index(header) + 1 :]))
    written = [csv_path, curves_path, log_path] + ([png_path] if drew else [])
    print("\nwrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
