"""A benchmark part (name, config, quick config, run, report, figures), its report as text or markdown, its plots."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

C = TypeVar("C")
Table = list[list[str]]  # the header row, then the body rows
Block = str | Table  # one item of a report: a paragraph (markdown; a "### " heading too) or a table
Result = dict[str, Any]  # what a part's run returns: JSON-ready figures
Figures = Callable[[Result, str], list[tuple[str, str]]]  # (result, folder) -> (file name, caption) per figure


def _no_figures(result: Result, folder: str) -> list[tuple[str, str]]:
    return []


@dataclass(frozen=True)
class Part(Generic[C]):
    """One benchmark: what `make bench` (or `python -m benchmarks.<name>`) measures, and how it reports it."""

    name: str  # its module under benchmarks/ and its key in results.json
    title: str  # the heading of its report
    config: C  # what a full run measures (a frozen dataclass; `--set field=value` replaces a field)
    quick: C  # A smoke run's config (`--quick`)
    run: Callable[[C], Result]  # measure: config -> JSON-ready result
    report: Callable[[Result], list[Block]]  # its tables and sentences (as text for stdout, as markdown for the docs)
    figures: Figures = _no_figures  # draw the result's figures into a folder
    block: str | Callable[[Result], str] = ""
    """The docs block (between `<!-- bench:BLOCK:begin/end -->` of docs/benchmarks.md) it writes; default `name`."""
    in_bench: bool = True  # False: run only when named (`--parts` or `python -m benchmarks.<name>`), not by make bench

    def text(self, result: Result) -> str:
        """The report as fixed-width text."""
        return render(self.report(result), markdown=False)

    def markdown(self, result: Result) -> str:
        """The report as GitHub markdown."""
        return render(self.report(result), markdown=True)

    def block_of(self, result: Result) -> str:
        """The docs block this result goes to."""
        return (self.block(result) if callable(self.block) else self.block) or self.name


def text_table(table: Table) -> str:
    """Fixed-width text (markdown emphasis dropped)."""
    rows = [[cell.replace("**", "") for cell in row] for row in table]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def markdown_table(table: Table) -> str:
    """A GitHub markdown table."""
    head, *body = table
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
                      *("| " + " | ".join(row) + " |" for row in body)])


def render(blocks: Sequence[Block], markdown: bool) -> str:
    """Paragraphs and tables, a blank line apart."""
    return "\n\n".join((markdown_table(b) if markdown else text_table(b)) if isinstance(b, list) else
                       b if markdown else b.removeprefix("### ").replace("**", "") for b in blocks)


def mark(ok: bool) -> str:
    """A table's verdict cell."""
    return "yes" if ok else "**no**"


def met(ok: bool) -> str:
    """A target's verdict in a sentence."""
    return "met" if ok else "**missed**"


def ms(seconds: float) -> str:
    """Seconds as milliseconds with one decimal."""
    return f"{seconds * 1e3:.1f}"


def with_settings(config: C, settings: Sequence[str]) -> C:
    """`config` with each "field=value" (JSON, a Python literal, a comma list, or text); ValueError for an unknown
    field or bad value. A tuple field takes `()` (empty), a JSON list or Python tuple, or a comma list; where its
    items are tuples (e.g. `cases`), each comma-separated item is split at ":" (`cases=1f1b:mlp:60,zbv:sleep:4`)."""
    names = [f.name for f in dataclasses.fields(config)]  # type: ignore[arg-type]
    changes: dict[str, Any] = {}
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or key not in names:
            raise ValueError(f"--set {setting!r}: expected FIELD=VALUE with FIELD one of {names}")
        current, value = getattr(config, key), _literal(text)
        if isinstance(current, (int, float)) and not isinstance(value, (int, float)):
            raise ValueError(f"--set {setting!r}: {key} takes a number, got {text!r}")
        if isinstance(current, tuple):
            value = _tuple_of(current, value, text)
        changes[key] = text if isinstance(current, str) else float(value) if isinstance(current, float) else value
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]


def _tuple_of(current: tuple[Any, ...], value: Any, text: str) -> tuple[Any, ...]:
    """A tuple field's new value from its parsed `value` (or its `text`, a comma list)."""
    nested = any(isinstance(v, tuple) for v in current)
    if isinstance(value, (list, tuple)):
        items = list(value)
        if nested and items and not any(isinstance(v, (list, tuple)) for v in items):
            items = [items]  # one item of a tuple of tuples, given flat
    elif nested:
        items = [[_literal(part) for part in item.split(":")] for item in text.split(",") if item.strip()]
    else:
        items = [_literal(v) for v in text.split(",") if v.strip()]
    return tuple(tuple(v) if isinstance(v, (list, tuple)) else v for v in items)


def _literal(text: str) -> Any:
    """JSON, else a Python literal, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def figure(width: float, height: float, dpi: int = 110, layout: Literal["constrained"] | None = "constrained") -> Any:
    """A matplotlib Figure (no pyplot state)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=dpi, layout=layout)


def bars(path: str, labels: Sequence[str], series: dict[str, list[float]], target: float, target_text: str,
         ylabel: str, title: str) -> None:
    """Grouped bars with their values and a dashed target line; a NaN value draws no bar (a series without that
    label)."""
    fig = figure(10.5, 3.4)
    ax = fig.subplots()
    count = max(len(series), 1)
    width = 0.8 / count
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (count - 1) / 2) * width for i in range(len(values))]
        drawn = ax.bar(xs, values, width=width * 0.95, label=name)
        for bar, value in zip(drawn, values, strict=True):
            if math.isnan(value):
                continue
            ax.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7, zorder=3,
                        bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none"})
    ax.axhline(target, color="#c0392b", linestyle="--", linewidth=1, zorder=2)  # values stay readable across it
    ax.annotate(target_text, (1.0, target), xycoords=("axes fraction", "data"), xytext=(-2, 3),
                textcoords="offset points", ha="right", va="bottom", fontsize=7.5, color="#c0392b")
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8.5)
    ax.set_title(title, fontsize=9.5)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_ylim(0, max([target * 1.25] + [v * 1.4 for vals in series.values() for v in vals if not math.isnan(v)]))
    if len(series) > 1:
        ax.legend(fontsize=7.5, loc="upper center", ncols=3)
    fig.savefig(path)
