"""Tests of the stacked figures: schedules on one time axis, and a measured run beside its simulation."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from _viz_cases import P, as_measured, hand_timeline, schedule_names, simulated

from duplexpipe.viz import _style as st
from duplexpipe.viz.compare import plot_comparison, plot_measured_vs_simulated
from duplexpipe.viz.gantt import DPI

imread = pytest.importorskip("matplotlib.image").imread


def boxes(ax: Any) -> list[Any]:
    return [p for p in ax.patches if (p.get_gid() or "").startswith(st.BOX_GID)]


def texts(ax: Any) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_comparison_stacks_every_schedule_on_one_axis(tmp_path: Path) -> None:
    names = ["1f1b", "zb-h1", "dualpipe", "dualpipev"]
    timelines = [simulated(n)[1] for n in names]
    path = tmp_path / "cmp.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plot_comparison(timelines, path)
    assert len(fig.axes) == len(names)
    xmax = max(t.makespan for t in timelines)
    for ax, name, tl in zip(fig.axes, names, timelines, strict=True):
        assert ax.get_xlim() == pytest.approx((0, xmax))
        assert len(boxes(ax)) == len(tl.events)
        peak = max(tl.peak_activations(r) for r in range(tl.num_ranks))
        header = " ".join(texts(ax))
        assert st.display_name(name) in header
        assert f"bubble {tl.bubble_ratio:.1%}" in header and f"peak activations {peak}" in header
    assert imread(path).shape[:2] == tuple(round(v) for v in fig.get_size_inches()[::-1] * DPI)


def test_comparison_of_every_schedule_in_svg(tmp_path: Path) -> None:
    timelines = [simulated(n)[1] for n in schedule_names()]
    path = tmp_path / "all.svg"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_comparison(timelines, path, title="all of them")
    text = path.read_text()
    assert text.count(f'id="{st.BOX_GID}-') == sum(len(t.events) for t in timelines)
    for i in range(len(timelines)):
        assert f'id="{st.BOX_GID}-{i}-r0-' in text


def test_comparison_rejects_bad_input(tmp_path: Path) -> None:
    _, tl = simulated("1f1b")
    with pytest.raises(ValueError, match="at least one"):
        plot_comparison([], tmp_path / "x.png")
    with pytest.raises(ValueError, match="one unit"):
        plot_comparison([tl, as_measured(tl, 0.01, 5.0)], tmp_path / "x.png")
    with pytest.raises(ValueError, match="'.gif'"):
        plot_comparison([tl], tmp_path / "x.gif")


def test_measured_vs_simulated_shares_the_time_axis(tmp_path: Path) -> None:
    _, sim = simulated("dualpipe")
    measured = as_measured(sim, 0.004, origin=50.0)
    path = tmp_path / "mvs.svg"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plot_measured_vs_simulated(measured, sim, path)
    top, bottom = fig.axes
    assert top.get_xlim() == pytest.approx(bottom.get_xlim())
    assert bottom.get_xlabel() == "time (ms)"
    # the measured run is the simulation scaled by 4 ms per unit: after scaling, the boxes coincide
    spans_top = sorted((round(b.get_x(), 6), round(b.get_width(), 6)) for b in boxes(top))
    spans_bottom = sorted((round(b.get_x(), 6), round(b.get_width(), 6)) for b in boxes(bottom))
    assert spans_top == spans_bottom and len(spans_top) == len(sim.events)
    note = " ".join(t.get_text() for t in fig.texts)
    assert "1 cost unit = 4 ms" in note and "scaled" in note


def test_measured_vs_simulated_rejects_mismatch(tmp_path: Path) -> None:
    _, sim = simulated("1f1b")
    other = hand_timeline([[("0F0", 0, 1)]], num_microbatches=1)
    with pytest.raises(ValueError, match=f"1 ranks but simulated has {P}"):
        plot_measured_vs_simulated(other, sim, tmp_path / "x.png")


def test_measured_vs_simulated_in_one_unit_is_not_rescaled(tmp_path: Path) -> None:
    _, sim = simulated("dualpipe")
    measured = as_measured(sim, 0.004, origin=0.0)
    sim_seconds = as_measured(sim, 0.002, origin=0.0)  # same unit, half the durations
    fig = plot_measured_vs_simulated(measured, sim_seconds, tmp_path / "same.png")
    top, bottom = fig.axes
    widths_top = sum(b.get_width() for b in boxes(top))
    widths_bottom = sum(b.get_width() for b in boxes(bottom))
    assert widths_bottom == pytest.approx(widths_top / 2)
    assert "unscaled" in " ".join(t.get_text() for t in fig.texts)
    titles = " | ".join([ax.get_title() for ax in fig.axes] + [t.get_text() for ax in fig.axes for t in ax.texts]
                        + [t.get_text() for t in fig.texts])
    assert f"makespan {measured.makespan * 1e3:.3g} ms" in titles, titles  # the demo once said "0.1 s"
    assert f"makespan {sim_seconds.makespan * 1e3:.3g} ms " in titles and " = " not in titles, titles
