"""Timing, peak-memory and CSV helpers shared by the benchmarks.

Times are medians over CUDA-event-timed iterations after warm-up; memory is the peak the
caching allocator saw during one call, over what was allocated before it (so weights and
inputs already resident do not count, and the call's own output does).
"""

from __future__ import annotations

import csv
import gc
import pathlib
import statistics
import time
from collections.abc import Callable


def free_cuda() -> None:
    """Drop unreachable tensors and return cached blocks, so the next provider starts clean."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cuda_time_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    iters: int = 10,
    before: Callable[[], object] | None = None,
) -> float:
    """Median wall time of ``fn()`` on the current CUDA stream, in milliseconds.

    ``before`` runs untimed ahead of every call (e.g. clearing ``.grad``). A fixed iteration
    count (not a time budget) keeps slow model-level steps from being timed once.
    """
    import torch

    times = []
    for i in range(warmup + iters):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_graph(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    before_capture: Callable[[], object] | None = None,
) -> tuple[object, object]:
    """(graph, fn's output in the capture): ``fn()`` run ``warmup`` times on a side stream (so
    caches, cuBLAS workspaces and Triton compiles stay out of the capture), then
    ``before_capture()`` if given, then captured into a ``torch.cuda.CUDAGraph``."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def torch_time_rounds(
    calls: dict[str, Callable[[], object]], *, rounds: int, per_round: int, timing: str
) -> dict[str, list[float]]:
    """name -> [µs per call in each round], the calls taking turns: ``timing`` "gpu" (CUDA
    events around ``per_round`` back-to-back calls: device time) or "host" (perf_counter
    around them, the wait for the device after the clock stops: what a host-bound caller
    pays). Every call runs once before the first round."""
    import torch

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for call in calls.values():
        call()
    sync()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            if timing == "gpu":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(per_round):
                    call()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1e3 / per_round)
                continue
            t0 = time.perf_counter()
            for _ in range(per_round):
                call()
            times[name].append((time.perf_counter() - t0) * 1e6 / per_round)
            sync()
    return times


def positive_int(text: str) -> int:
    """An argparse ``type``: an int ≥ 1 (argparse names the flag when this raises)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def cuda_peak_bytes(fn: Callable[[], object], *, before: Callable[[], object] | None = None) -> int:
    """Peak bytes allocated during one ``fn()`` call above the level just before it.

    The result of ``fn`` is kept alive until the peak is read, then dropped.
    """
    import torch

    if before is not None:
        before()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    del out
    return int(peak)


def jax_time_ms(fn: Callable[[], object], *, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of ``fn()`` (a jitted JAX call) until its result is ready, in ms."""

    import jax

    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def jax_time_rounds(
    calls: dict[str, Callable[[], object]],
    *,
    rounds: int,
    per_round: int,
    warmup: int = 3,
    back_to_back: bool = False,
) -> dict[str, list[float]]:
    """name -> [ms per call in each round]: the calls take turns, round after round, so a
    drift of the GPU's clocks over the run reaches every one of them alike (benchmarks/NOTES.md,
    session 29). Each call is a jitted JAX call. By default each call is timed until its
    result is ready and a round gives the median of its ``per_round`` calls; with
    ``back_to_back`` a round dispatches its ``per_round`` calls without waiting between them
    (as a training loop does, the host preparing the next step while the GPU runs this one)
    and gives the mean, the time until the last result is ready over ``per_round``."""

    import jax

    for call in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(call())
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            if back_to_back:
                t0 = time.perf_counter()
                for _ in range(per_round):
                    out = call()
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - t0) * 1e3 / per_round)
                continue
            samples = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                samples.append((time.perf_counter() - t0) * 1e3)
            times[name].append(statistics.median(samples))
    return times


def add_round_args(ap, *, rounds: int, per_round: int) -> None:
    """``--rounds`` and ``--per-round`` (calls back to back) of a probe timed by
    ``jax_time_rounds``; ``round_args`` reads them back, checked."""
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--per-round", type=int, default=per_round, help="calls per round, in a row")


def round_args(ap, args) -> dict:
    """``{"rounds": …, "per_round": …}`` from ``add_round_args``' flags; an argparse error
    (exit 2) naming the flag if either is below 1."""
    out = {"rounds": args.rounds, "per_round": args.per_round}
    for name, value in out.items():
        if value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {value}")
    return out


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float | None:
    """The median over rounds of ``times[num][k] / times[den][k]`` (``jax_time_rounds``'
    rounds); None if either is missing."""
    a, b = times.get(num), times.get(den)
    if not a or not b:
        return None
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def jax_temp_bytes(jitted, *args) -> int | None:
    """XLA's compiled temporary buffer size for ``jitted(*args)`` (None if not reported)."""
    return compiled_temp_bytes(jitted.lower(*args).compile())


def compiled_temp_bytes(compiled) -> int | None:
    """A compiled program's temporary buffer size (None if XLA does not report one)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return int(analysis.temp_size_in_bytes)


def write_csv(path, rows: list[dict], fields: list[str] | None = None) -> pathlib.Path:
    """Write ``rows`` (dicts) to ``path`` as CSV; ``fields`` defaults to every key of every row
    in order of first appearance, and keys a row lacks are written empty. Creates the parent
    folder."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fields is None:
        fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def error_text(e: BaseException) -> str:
    """A failed measurement's CSV cell: the exception type and its first line, truncated."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"[:300]


def log_row(bench: str, name: str, row: dict) -> None:
    """One provider's floats (and error, if any) on one line of the run log."""
    floats = ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float))
    error = f" ERROR {row['error']}" if row.get("error") else ""
    print(f"[{bench}] {name}: {floats}{error}", flush=True)
