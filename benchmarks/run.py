"""`make gpu`: every GPU test and benchmark in one call, a short table last.

Runs on the GPU machine with its preinstalled packages (installs nothing).

Protocol for benchmark modules: each ``benchmarks/bench_*.py`` defines
``run(out_dir: pathlib.Path) -> list[dict]``. It writes its full results as CSV
under ``out_dir`` and returns a few summary rows, each a dict with keys
``bench``, ``metric``, ``value`` and optionally ``target`` (a string such as
``"<= 1.10"``) and ``ok`` (bool or None). This script prints those rows last.
A module that sets ``IN_MAKE_GPU = False`` (a probe with its own command line, e.g.
``bench_jax_parts``) is not run here; ``python3 -m benchmarks.<name>`` runs it.

    python3 -m benchmarks.run [--only NAME ...] [--skip-tests] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import subprocess
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
# torch and JAX benchmarks share one process: JAX must not grab 75% of the card up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _bench_modules(only):
    names = sorted(p.stem for p in HERE.glob("bench_*.py"))
    if only:
        names = [n for n in names if any(o in n for o in only)]
    return names


def in_make_gpu(module) -> bool:
    """Whether ``make gpu`` runs this bench module (module doc: ``IN_MAKE_GPU``)."""
    return getattr(module, "IN_MAKE_GPU", True)


def _gpu_state(tag: str) -> None:
    """Print the GPU's clocks, power and temperature: latency-bound kernels move with the SM
    clock between machines (benchmarks/NOTES.md), so every run logs it before and after."""
    query = "name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return
    print(f"[gpu state {tag}] {query}: {out}", flush=True)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[], help="substrings of bench module names")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    test_rc = 0
    if not args.skip_tests:
        # GPU-marked tests, then the parity suite, which runs its torch tiers and the
        # dora_jax XLA path natively when a GPU is present.
        test_rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"])
        parity_rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/parity"])
        test_rc = test_rc if test_rc not in (0, 5) else parity_rc

    rows, failures = [], []
    _gpu_state("before")
    for name in _bench_modules(args.only):
        t0 = time.time()
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
            if not in_make_gpu(mod):
                print(f"[{name}] not part of make gpu: python3 -m benchmarks.{name}")
                continue
            rows += mod.run(out)
        except Exception:
            traceback.print_exc()
            failures.append(name)
        print(f"[{name}] {time.time() - t0:.1f}s", flush=True)

    _gpu_state("after")
    print("\n=== summary ===")
    if not args.skip_tests:
        print(f"GPU tests: {'passed' if test_rc == 0 else f'FAILED (pytest exit {test_rc})'}")
    for f in failures:
        print(f"benchmark {f}: CRASHED (traceback above)")
    if rows:
        w = max(len(f"{r['bench']}: {r['metric']}") for r in rows)
        for r in rows:
            ok = r.get("ok")
            mark = "" if ok is None else ("  ok" if ok else "  MISS")
            tgt = f"  target {r['target']}" if r.get("target") else ""
            print(f"{r['bench'] + ': ' + r['metric']:<{w}}  {_fmt(r['value']):>10}{tgt}{mark}")
    return 1 if (test_rc not in (0, 5) or failures) else 0


if __name__ == "__main__":
    raise SystemExit(main())
