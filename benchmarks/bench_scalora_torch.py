"""ScaLoRA's GPU cost on Llama-8B shapes (issue 12, item 6), torch backend.

Model: the 8-layer Llama-8B-shaped model of ``bench_model_torch`` (bf16 base), PEFT LoRA on
all seven projections with PEFT's default fp32 adapters, ``lora_alpha = 2r``, batch 1 × 2048.
A step is ``zero_grad → forward → backward → [ScaLoRA.step()] → AdamW.step()``. Variants:
``lora`` (no ScaLoRA), ``scalora`` (every step), ``scalora_i10`` and ``scalora_i100``
(ScaLoRA-I, I = 10 and 100). Each variant trains its own copy of the base (ScaLoRA writes W).

Reported per variant: the mean step time over ``max(20, I)`` steps after 3 warm-up steps
(a mean, not a median: ScaLoRA-I's merge happens once every I steps, and its cost is the
amortised one), and the peak memory of the measured steps over what was allocated before
them. Ratios are against ``lora`` of the same rank, in the same run.

    python3 -m benchmarks.bench_scalora_torch --ranks 8 64
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

from benchmarks import bench_model_torch as bm
from benchmarks.measure import free_cuda, write_csv

VARIANTS = {"lora": 0, "scalora": 1, "scalora_i10": 10, "scalora_i100": 100}
TARGETS = {"scalora": 1.35, "scalora_i100": 1.02}  # step time / LoRA's (issue 12)
FIELDS = ["date", "commit", "gpu", "variant", "rank", "interval", "steps", "step_mean_ms",
          "peak_gib", "time_ratio", "peak_ratio"]  # fmt: skip
GIB = 2.0**30


def measure(rank: int, interval: int, *, layers: int = 8) -> dict:
    import torch

    from dora_torch.scalora import ScaLoRA

    ids = torch.randint(0, bm.VOCAB, (1, bm.SEQ), device="cuda")
    torch.manual_seed(0)
    model = bm._wrap(bm.build_base(layers), "peft_lora_fp32", rank)
    with torch.no_grad():  # PEFT starts at B = 0; ScaLoRA's column branch needs B ≠ 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
    scalora = ScaLoRA(model, opt, interval=interval) if interval else None
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        if scalora is not None:
            scalora.step()
        opt.step()

    for _ in range(3):
        step()
    steps = max(20, interval)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    peak = (torch.cuda.max_memory_allocated() - before) / GIB
    return {"rank": rank, "interval": interval, "steps": steps, "step_mean_ms": round(ms, 2),
            "peak_gib": round(peak, 3)}  # fmt: skip


def variant_rows(bench: str, rank: int, got: dict[str, dict]) -> list[dict]:
    """Each variant's row with its name and its time and peak ratios to ``lora`` (no peak
    ratio where a peak is missing), printed (both backends' benches)."""
    base = got["lora"]
    rows = []
    for name, row in got.items():
        row["variant"] = name
        row["time_ratio"] = round(row["step_mean_ms"] / base["step_mean_ms"], 3)
        peaks = (row.get("peak_gib"), base.get("peak_gib"))
        row["peak_ratio"] = None if None in peaks else round(peaks[0] / peaks[1], 3)
        peak = "n/a" if peaks[0] is None else f"{peaks[0]:.3f} GiB ({row['peak_ratio']:.3f}×)"
        rises = f"; peak rose at step:GiB {row['peak_rises']}" if row.get("peak_rises") else ""
        rises += f"; phases (ms) {row['phases_ms']}" if row.get("phases_ms") else ""
        print(f"[{bench}] r={rank} {name:<13} {row['step_mean_ms']:8.2f} ms "
              f"({row['time_ratio']:.3f}× LoRA), peak {peak}{rises}", flush=True)  # fmt: skip
        rows.append(row)
    return rows


def summary_rows(bench: str, rank: int, got: dict[str, dict]) -> list[dict]:
    """The issue's targets against each variant's ``time_ratio`` (both backends' benches)."""
    out = []
    for name, target in TARGETS.items():
        if name not in got:  # a variant left out of this run
            continue
        ratio = got[name]["time_ratio"]
        out.append({"bench": bench, "metric": f"{name}/LoRA step [r={rank}]", "value": ratio,
                    "target": f"<= {target}", "ok": ratio <= target})  # fmt: skip
    return out


def _bench(out_dir, ranks) -> list[dict]:
    out_dir = pathlib.Path(out_dir)
    rows, summary, meta = [], [], bm._meta()
    for rank in ranks:
        got = {}
        for name, interval in VARIANTS.items():
            got[name] = {**meta, **measure(rank, interval)}
            free_cuda()  # the variant's model copy is gone with measure's frame
        rows += variant_rows("scalora_torch", rank, got)
        summary += summary_rows("scalora_torch", rank, got)
    write_csv(out_dir / "scalora_torch.csv", rows, FIELDS)
    return summary


def run(out_dir: pathlib.Path) -> list[dict]:
    """``benchmarks.run`` protocol: r = 8 and 64."""
    return _bench(out_dir, [8, 64])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench")
    args = ap.parse_args(argv)
    for row in _bench(args.out, args.ranks):
        print(f"{row['metric']}: {row['value']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
