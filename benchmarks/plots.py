"""Line plots for the demo and the benchmarks (matplotlib, headless).

matplotlib is optional: without it ``line_plot`` returns False and writes nothing, so a
missing plotting library never fails a run whose CSV holds the same numbers.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

_STYLES = ("-", "--", ":", "-.")


def line_plot(
    path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
    lower: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    lower_ylabel: str = "",
) -> bool:
    """Write a PNG with one line per entry of ``series`` (label → (x values, y values)).

    Lines after the first are dashed, so curves that coincide stay visible. ``lower`` adds a
    second panel below with a log y axis (e.g. the per-step difference of two curves).
    Returns True if the file was written, False if matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on CI or the GPU machine
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = 1 if lower is None else 2
    fig, axes = plt.subplots(
        panels,
        1,
        figsize=(7, 4 + 2 * (panels - 1)),
        dpi=120,
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [2, 1][:panels]},
    )
    ax = axes[0, 0]
    for i, (label, (x, y)) in enumerate(series.items()):
        ax.plot(x, y, label=label, linewidth=2.2 if i == 0 else 1.2, linestyle=_STYLES[i % 4])
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, ylabel=ylabel, xlabel="" if lower else xlabel)
    ax.grid(alpha=0.3)
    ax.legend()
    if lower is not None:
        low = axes[1, 0]
        for label, (x, y) in lower.items():
            low.plot(x, y, label=label, linewidth=0.8, marker=".", markersize=3)
        low.set_yscale("log")
        low.set(xlabel=xlabel, ylabel=lower_ylabel)
        low.grid(alpha=0.3)
        low.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
