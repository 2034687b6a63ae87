"""Pictures of a plan and of a run, drawn with matplotlib (the ``Agg`` backend: no display).

One module for every picture flowrl makes: ``flowrl plan --output`` draws its predicted
timeline with :func:`timeline`, and ``flowrl report`` draws the measured one with the same
function, next to the curves, the per-node comparison and the device utilisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac"]
WAIT_COLOR = "#d9d9d9"
MARK_COLORS = {"fault": "#d62728", "move": "#9467bd", "resume": "#2ca02c"}


@dataclass(frozen=True)
class Bar:
    """One bar of a timeline: ``task`` on ``lane`` from ``start_s`` to ``end_s``."""

    lane: str
    task: str
    start_s: float
    end_s: float
    waiting: bool = False
    """Time a call waited for its inputs (drawn grey, behind its computing)."""
    emphasised: bool = False
    """Drawn with a black outline (the critical path of a plan)."""


@dataclass(frozen=True)
class Mark:
    """A vertical line at ``x`` (a fault, a move, a resume), with ``label`` and its colour by ``kind``."""

    x: float
    kind: str
    label: str


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def task_colors(tasks: list[str]) -> dict[str, str]:
    return {task: PALETTE[index % len(PALETTE)] for index, task in enumerate(dict.fromkeys(tasks))}


def timeline(bars: list[Bar], lanes: list[str], title: str, path: Path, lane_labels: dict[str, str] | None = None,
             unit_ms: bool = True) -> None:
    """One lane per device, a bar per task (waits grey), written to ``path`` (.png, .svg)."""
    pyplot = _pyplot()
    colors = task_colors([bar.task for bar in bars if not bar.waiting])
    scale = 1e3 if unit_ms else 1.0
    figure, axes = pyplot.subplots(figsize=(10, 0.55 * len(lanes) + 1.6))
    end = max((bar.end_s for bar in bars), default=1.0) * scale
    lanes = list(lanes) + sorted({bar.lane for bar in bars} - set(lanes))
    for bar in bars:
        row = lanes.index(bar.lane)
        width = max((bar.end_s - bar.start_s) * scale, end / 500)
        if bar.waiting:
            # a call waits while other calls compute on the same worker: a thin grey line
            # under the lane, behind the computations
            axes.barh(row + 0.38, width, left=bar.start_s * scale, color=WAIT_COLOR, height=0.12, zorder=1)
            continue
        color = colors[bar.task]
        axes.barh(row, width, left=bar.start_s * scale, color=color, height=0.6, zorder=2,
                  edgecolor="black" if bar.emphasised else color, linewidth=1.5 if bar.emphasised else 0)
        if width > end * 0.06:
            axes.text(bar.start_s * scale + width / 2, row, bar.task, va="center", ha="center", fontsize=8,
                      color="white", zorder=3)
    labels = lane_labels or {}
    axes.set_yticks(range(len(lanes)), [labels.get(lane, lane) for lane in lanes])
    axes.invert_yaxis()
    axes.set_xlabel("ms" if unit_ms else "s")
    axes.set_title(title, fontsize=10)
    handles = [pyplot.Rectangle((0, 0), 1, 1, color=color) for color in colors.values()]
    names = list(colors)
    if any(bar.waiting for bar in bars):
        handles.append(pyplot.Rectangle((0, 0), 1, 1, color=WAIT_COLOR))
        names.append("waiting for inputs")
    from matplotlib.transforms import ScaledTranslation

    figure.tight_layout()
    # under the tick labels and the axis label: an offset in inches, whatever the axes' height
    below = axes.transAxes + ScaledTranslation(0, -0.5, figure.dpi_scale_trans)
    legend = axes.legend(handles, names, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0),
                         bbox_transform=below, ncol=min(6, len(names)), frameon=False)
    figure.savefig(path, dpi=110, bbox_inches="tight", bbox_extra_artists=[legend])
    pyplot.close(figure)


def curves(series: dict[str, tuple[list[float], list[float]]], path: Path, marks: tuple[Mark, ...] = (),
           x_label: str = "step", columns: int = 2) -> None:
    """Small line plots, one per named series of (x, y), faults, moves and resumes as vertical lines."""
    pyplot = _pyplot()
    names = list(series)
    rows = max(1, -(-len(names) // columns))
    figure, grid = pyplot.subplots(rows, columns, figsize=(5 * columns, 2.6 * rows), squeeze=False)
    for index, axes in enumerate(grid.flat):
        if index >= len(names):
            axes.set_visible(False)
            continue
        xs, ys = series[names[index]]
        axes.plot(xs, ys, color=PALETTE[index % len(PALETTE)], linewidth=1.2, marker="." if len(xs) < 30 else None)
        for mark in marks:
            axes.axvline(mark.x, color=MARK_COLORS.get(mark.kind, "black"), linestyle="--", linewidth=0.8)
        axes.set_title(names[index], fontsize=9)
        axes.set_xlabel(x_label, fontsize=8)
        axes.tick_params(labelsize=7)
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def compared_bars(names: list[str], first: list[float], second: list[float], labels: tuple[str, str], title: str,
                  path: Path, unit: str = "ms") -> None:
    """Two bars per name (predicted and measured, say)."""
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(max(5.0, 1.1 * len(names) + 2), 3.2))
    positions = list(range(len(names)))
    axes.bar([p - 0.2 for p in positions], first, width=0.4, label=labels[0], color=PALETTE[0])
    axes.bar([p + 0.2 for p in positions], second, width=0.4, label=labels[1], color=PALETTE[1])
    axes.set_xticks(positions, names, fontsize=8)
    axes.set_ylabel(unit)
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8)
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
