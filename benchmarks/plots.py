"""Figure helpers of the benchmark parts (matplotlib, imported when a figure is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def figure(width: float, height: float) -> Any:
    """A matplotlib Figure (no pyplot state)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def bars(path: str, labels: Sequence[str], series: dict[str, list[float]], target: float, target_text: str,
         ylabel: str, title: str, extra_line: tuple[float, str] | None = None) -> None:
    """Grouped bars with their values, a dashed target line (and a dotted `extra_line`: (value, label))."""
    fig = figure(10.5, 3.4)
    ax = fig.subplots()
    count = max(len(series), 1)
    width = 0.8 / count
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (count - 1) / 2) * width for i in range(len(values))]
        drawn = ax.bar(xs, values, width=width * 0.95, label=name)
        for bar, value in zip(drawn, values, strict=True):
            ax.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax.axhline(target, color="#c0392b", linestyle="--", linewidth=1)
    ax.annotate(target_text, (1.0, target), xycoords=("axes fraction", "data"), xytext=(-2, 3),
                textcoords="offset points", ha="right", va="bottom", fontsize=7.5, color="#c0392b")
    if extra_line is not None:
        ax.axhline(extra_line[0], color="#7f8c8d", linestyle=":", linewidth=1, label=extra_line[1])
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8.5)
    ax.set_title(title, fontsize=9.5)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_ylim(0, max([target * 1.25] + [v * 1.4 for vals in series.values() for v in vals]))
    if len(series) > 1 or extra_line is not None:
        ax.legend(fontsize=7.5, loc="upper center", ncols=3)
    fig.savefig(path)
