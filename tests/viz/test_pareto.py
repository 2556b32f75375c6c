"""The planner's Pareto figure: the front of step time vs peak memory, and the drawn file."""

from __future__ import annotations

from pathlib import Path

import pytest

from duplexpipe.planner.plan import PlanConfig, PlanResult, PlanRow, plan
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


@pytest.mark.parametrize("chunks", [(4,), (2, 4, 8)])
def test_the_legend_is_inside_the_figure(tmp_path: Path, chunks: tuple[int, ...]) -> None:
    """A long best label ("best: interleaved-1f1b(chunks=4) M=16") once ran past the figure's right edge."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    parts = tuple(PartProfile(1e-3, 1e-3, 1e-3, MIB, 8 * MIB, 64 * 1024, 64 * 1024) for _ in range(16))
    result = plan(Profile(parts, 4), PlanConfig(ranks=2, dp=2, batch=64, memory=2000 * MIB,
                                                schedules=("interleaved-1f1b", "1f1b", "zbv"), chunks=chunks))
    fig = plot_pareto(result, tmp_path / "pareto.png")
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.x0 >= ax.get_window_extent(renderer).x1, "right of the axes"
    assert legend.x1 <= fig.bbox.x1 and legend.y0 >= fig.bbox.y0 and legend.y1 <= fig.bbox.y1
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("best: interleaved-1f1b(chunks=") for t in texts) or "best: ZB-V" in " ".join(texts)


def test_front_labels_do_not_overlap(tmp_path: Path) -> None:
    """Labels of close points on the front overlapped on `plan --plot`'s chart."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Annotation, Text

    crowded = [row(f"s{k}", 10.0 - 0.05 * k, 5 * MIB + 0.02 * MIB * k) for k in range(8)]
    rows = sorted([*crowded, row("far", 30.0, 1 * MIB)], key=lambda r: r.step_s)
    result = PlanResult(PlanConfig(ranks=2, batch=16, memory=80 * MIB), tuple(rows), "")  # crowded, all on the front
    fig = plot_pareto(result, tmp_path / "crowded.png")
    renderer = FigureCanvasAgg(fig).get_renderer()
    notes = [a for a in fig.axes[0].texts if isinstance(a, Annotation)]
    for note in notes:
        note.update_positions(renderer)
    boxes = [Text.get_window_extent(a, renderer) for a in notes]  # the text, not its leader line
    assert len(boxes) == len(pareto_front([r for r in result.rows if r.feasible]))
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
