"""PNG bar charts of bench results: kvtier next to its baseline, row by row (``--plot DIR``).

matplotlib is an optional extra (``pip install 'kvtier[plot]'``); it is imported only when a
chart is drawn, and :func:`require_matplotlib` lets the CLI fail before a long run rather than
after it.

One file per suite, ``<DIR>/<suite>.png``: one panel per (metric, unit) of the suite's rows, each
row a pair of horizontal bars (kvtier, baseline) labelled with the case and the ratio. A panel
whose values span more than three decades uses a log axis. A suite without rows gets no file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from kvtier.bench.report import Row, SuiteResult

KVTIER_COLOR = "#1f77b4"
BASELINE_COLOR = "#b0b0b0"
BAR_HEIGHT = 0.38
ROW_INCHES = 0.55  # vertical room per row, so long suites stay readable


class PlotUnavailable(RuntimeError):
    """``--plot`` was asked for and matplotlib is not installed."""


def require_matplotlib() -> ModuleType:
    """pyplot on the non-interactive Agg backend.

    Raises:
        PlotUnavailable: matplotlib is not importable (with the command that installs it).
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib, an optional extra: "
                              "pip install 'kvtier[plot]' (or pip install matplotlib)") from exc
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def plot_results(results: Sequence[SuiteResult], out_dir: str | Path) -> list[Path]:
    """Write one PNG per suite with rows into ``out_dir`` (created if needed); returns the paths.

    Raises:
        PlotUnavailable: matplotlib is missing.
    """
    plt = require_matplotlib()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for result in results:
        if not result.rows:
            continue
        path = out / f"{result.suite}.png"
        _suite_figure(plt, result, path)
        written.append(path)
    return written


def _panels(rows: Sequence[Row]) -> dict[tuple[str, str], list[Row]]:
    """Rows grouped by (metric, unit), in first-seen order (bars of one panel share an axis)."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.metric, r.unit), []).append(r)
    return groups


def _suite_figure(plt: ModuleType, result: SuiteResult, path: Path) -> None:
    panels = _panels(result.rows)
    heights = [max(1.6, ROW_INCHES * len(rows) + 0.9) for rows in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    try:
        for ax, ((metric, unit), rows) in zip(axes[:, 0], panels.items()):
            _panel(ax, metric, unit, rows)
        fig.suptitle(f"kvtier bench {result.suite}: kvtier vs baseline (ratio > 1: kvtier ahead)")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _panel(ax: object, metric: str, unit: str, rows: list[Row]) -> None:
    ys = range(len(rows))
    kv = [_finite(r.kvtier) for r in rows]
    base = [_finite(r.baseline) for r in rows]
    ax.barh([y - BAR_HEIGHT / 2 for y in ys], kv, BAR_HEIGHT, color=KVTIER_COLOR, label="kvtier")
    ax.barh([y + BAR_HEIGHT / 2 for y in ys], base, BAR_HEIGHT, color=BASELINE_COLOR, label="baseline")
    ax.set_yticks(list(ys))
    ax.set_yticklabels([f"{r.case}\nvs {r.baseline_name}  (ratio {r.ratio:.3g})" for r in rows], fontsize=7)
    ax.invert_yaxis()  # first row on top, as in the table
    positive = [v for v in kv + base if v > 0]
    if positive and max(positive) / min(positive) > 1e3:
        ax.set_xscale("log")
    ax.set_xlabel(f"{metric} ({unit})")
    ax.legend(loc="lower right", fontsize=7)
    ax.grid(axis="x", alpha=0.3)


def _finite(v: float) -> float:
    """NaN or infinite figures (a baseline the machine cannot run) draw as an empty bar."""
    return v if math.isfinite(v) else 0.0


__all__ = ["PlotUnavailable", "plot_results", "require_matplotlib"]
