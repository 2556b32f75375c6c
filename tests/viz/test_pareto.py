"""The planner's Pareto figure: the front of step time vs peak memory, and the drawn file."""

from __future__ import annotations

from pathlib import Path

import pytest

from duplexpipe.planner.plan import PlanConfig, PlanRow, plan
from duplexpipe.planner.profile import PartProfile, Profile
from duplexpipe.viz.pareto import pareto_front, plot_pareto

MIB = 2**20


def row(name: str, step: float, peak: float) -> PlanRow:
    return PlanRow(name, 4, 0, "none", step, step, 0.1, 0.0, peak)


def test_the_front_keeps_rows_nothing_beats_on_both_axes() -> None:
    rows = [row("a", 10, 5), row("b", 8, 6), row("c", 9, 7), row("d", 4, 9), row("e", 4, 10), row("f", 12, 4)]
    assert [r.schedule for r in pareto_front(rows)] == ["f", "a", "b", "d"]
    assert pareto_front([]) == []


def test_plot_writes_the_figure_with_every_candidate(tmp_path: Path) -> None:
    parts = tuple(PartProfile(1e-3, 1e-3, 1e-3, MIB, 8 * MIB, 64 * 1024, 64 * 1024) for _ in range(4))
    result = plan(Profile(parts, 4), PlanConfig(ranks=2, batch=16, memory=80 * MIB))
    fig = plot_pareto(result, tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").stat().st_size > 1000
    ax = fig.axes[0]
    drawn = sum(len(c.get_offsets()) for c in ax.collections)
    timed = [r for r in result.rows if r.peak_bytes == r.peak_bytes]
    assert drawn == len(timed) + 1  # every simulated candidate, and the star on the best
    assert "cap 80 MiB" in [t.get_text() for t in ax.get_legend().get_texts()]
    with pytest.raises(ValueError, match="unsupported figure format '.gif'"):
        plot_pareto(result, tmp_path / "pareto.gif")
