"""The demo's results: rows with optional pass/fail targets, a printed table and CSV files."""

from __future__ import annotations

import csv
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One line of the results table.

    ``peft`` and ``ours`` are per-provider values (either may be None); ``value`` is a
    comparison between them. A row with ``limit`` set is a check: it passes when ``value`` is
    finite and ``value <= limit`` (``at_least=False``) or ``value >= limit`` (``at_least=True``).
    """

    metric: str
    peft: float | None = None
    ours: float | None = None
    value: float | None = None
    limit: float | None = None
    at_least: bool = False

    @property
    def is_check(self) -> bool:
        return self.limit is not None

    @property
    def ok(self) -> bool | None:
        if not self.is_check:
            return None
        if self.value is None or not math.isfinite(self.value):
            return False
        return self.value >= self.limit if self.at_least else self.value <= self.limit

    @property
    def target(self) -> str:
        if not self.is_check:
            return ""
        return f"{'>=' if self.at_least else '<='} {_fmt(self.limit)}"


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if 0.999 < v < 1.0:  # cosines: show how far from 1, not "1"
            return f"1 - {1.0 - v:.1e}"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.6g}"
    return str(v)


def _verdict(row: Row) -> str:
    return "" if row.ok is None else ("ok" if row.ok else "FAIL")


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned plain-text table."""
    header = ("metric", "PEFT DoRA", "ours", "value", "target", "")
    cells = [header] + [
        (r.metric, _fmt(r.peft), _fmt(r.ours), _fmt(r.value), r.target, _verdict(r)) for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(header))).rstrip() for c in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_results_csv(path, rows: Sequence[Row]) -> None:
    """Columns: metric, peft, ours, value, target, ok (empty where not applicable)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["metric", "peft", "ours", "value", "target", "ok"])
        for r in rows:
            w.writerow([r.metric, _csv(r.peft), _csv(r.ours), _csv(r.value), r.target, _csv(r.ok)])


def write_curves_csv(path, columns: dict[str, Sequence[float]]) -> None:
    """One row per step: ``step`` then one column per entry of ``columns`` (equal lengths)."""
    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        raise ValueError(
            f"columns must have equal lengths; got { {k: len(v) for k, v in columns.items()} }"
        )
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *columns])
        for i, vals in enumerate(zip(*columns.values())):
            w.writerow([i + 1, *(repr(float(v)) for v in vals)])


def _csv(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    return repr(float(v)) if isinstance(v, float) else str(v)
