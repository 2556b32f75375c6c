"""Tests of the Gantt chart: every schedule renders headless, one box per compute action, labels and panels."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _viz_cases import M, P, as_measured, hand_timeline, schedule_names, simulated

from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.timeline import Timeline
from duplexpipe.viz import _style as st
from duplexpipe.viz._boxes import DETAIL_LIMIT
from duplexpipe.viz.gantt import (
    DPI,
    MAX_ACT_IN,
    MAX_ACT_ROWS,
    MAX_GANTT_IN,
    MemoryCurves,
    activation_bytes_curve,
    plot_timeline,
    transfer_pairs,
)

NAMES = schedule_names()

imread = pytest.importorskip("matplotlib.image").imread


def boxes(fig: Any) -> list[Any]:
    """The action boxes of a figure (patches whose gid marks them)."""
    return [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(st.BOX_GID)]


def arrows(fig: Any) -> list[Any]:
    return [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(st.ARROW_GID)]


def strict(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call `fn` with every warning raised as an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_renders_png_and_svg(name: str, tmp_path: Path) -> None:
    schedule, timeline = simulated(name)
    compute = sum(1 for _, _, a in schedule.iter_actions() if a.op.is_compute)
    png = tmp_path / f"{name}.png"
    fig = strict(plot_timeline, timeline, png, activations=True, transfers=True)
    assert len(boxes(fig)) == compute == len(timeline.events)
    pixels = imread(png)
    width, height = fig.get_size_inches() * DPI
    assert pixels.shape[:2] == (round(height), round(width))
    rgb = pixels[..., :3]
    inked = (rgb.min(axis=2) < 0.9).mean()
    assert 0.05 < inked < 0.9, f"{name}: {inked:.1%} of the pixels are not white"
    assert len({tuple(px) for px in (rgb[::7, ::7].reshape(-1, 3) * 255).astype(int)}) > 10
    svg = tmp_path / f"{name}.svg"
    fig = strict(plot_timeline, timeline, svg)
    text = svg.read_text()
    assert text.count(f'id="{st.BOX_GID}-') == compute, "one SVG element per compute action"
    assert st.display_name(name) in text or st.display_name(name) in fig.texts[0].get_text()


def test_pdf_and_unsaved_figure(tmp_path: Path) -> None:
    _, timeline = simulated("1f1b")
    path = tmp_path / "g.pdf"
    strict(plot_timeline, timeline, path)
    assert path.read_bytes().startswith(b"%PDF")
    fig = strict(plot_timeline, timeline, None)
    assert len(boxes(fig)) == len(timeline.events)


def test_box_geometry_colour_and_labels_follow_the_events() -> None:
    _, timeline = simulated("1f1b")
    fig = plot_timeline(timeline, None)
    ax = fig.axes[0]
    by_gid = {b.get_gid(): b for b in boxes(fig)}
    for e in timeline.events:
        box = by_gid[f"{st.BOX_GID}-0-r{e.rank}-s{e.action.stage}{e.action.op.value}m{e.action.microbatch}"]
        assert box.get_x() == pytest.approx(e.start - timeline.start)
        assert box.get_width() == pytest.approx(e.duration)
        assert e.rank - 0.5 < box.get_y() < e.rank
        expected = st.KIND_COLORS[e.action.op.value][0]
        assert box.get_facecolor()[:3] == pytest.approx(_rgb(expected))
    labels = Counter(t.get_text() for t in ax.texts if t.get_text().isdigit())
    assert labels == Counter(str(e.action.microbatch) for e in timeline.events), "every box shows its microbatch"


def _rgb(hex_color: str) -> tuple[float, ...]:
    return tuple(int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))


def test_dualpipe_pairs_are_split_and_directions_shaded() -> None:
    _, timeline = simulated("dualpipe")
    fig = plot_timeline(timeline, None)
    ax = fig.axes[0]
    halves = [p for p in ax.patches if p.get_gid() is None and p.get_zorder() == 2]
    pairs = [e for e in timeline.events if e.action.op is Op.OVERLAP_F_B]
    assert pairs and len(halves) == 2 * len(pairs)
    fills = {tuple(round(c, 3) for c in p.get_facecolor()[:3]) for p in boxes(fig) + halves if p.get_fill()}
    for kind in ("F", "B"):
        light, dark = (tuple(round(c, 3) for c in _rgb(c)) for c in st.KIND_COLORS[kind])
        assert light in fills and dark in fills, f"both directions of {kind} are drawn"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "F&B overlapped pair" in legend
    assert any("down" in t for t in legend) and any("up" in t for t in legend)


def test_title_and_idle_shares() -> None:
    _, timeline = simulated("zb-h1")
    fig = plot_timeline(timeline, None)
    title = fig.texts[0].get_text()
    assert all(part in title for part in ("ZB-H1", f"{P} ranks", f"{M} microbatches",
                                           f"bubble {timeline.bubble_ratio:.1%}"))
    shares = [t.get_text() for t in fig.axes[0].texts if t.get_text().endswith("%")]
    assert shares == [f"{timeline.idle(r) / timeline.makespan:.1%}" for r in range(P)]


def test_activation_panel_reports_each_peak() -> None:
    _, timeline = simulated("1f1b")
    fig = plot_timeline(timeline, None, activations=True)
    assert len(fig.axes) == 2
    peaks = [t.get_text() for t in fig.axes[1].texts if t.get_text().startswith("peak")]
    assert peaks == [f"peak {timeline.peak_activations(r)}" for r in range(P)] == [f"peak {P - r}" for r in range(P)]
    assert fig.axes[1].get_xlim() == fig.axes[0].get_xlim()


def test_the_byte_model_curve_weights_the_count_curve_by_stage_bytes() -> None:
    _, timeline = simulated("1f1b")
    for rank in range(P):
        counts = timeline.activation_curve(rank)
        assert activation_bytes_curve(timeline, rank, [100.0] * P) == [(t, 100.0 * n) for t, n in counts]
    assert max(b for _, b in activation_bytes_curve(timeline, 0, [3.0] + [0.0] * (P - 1))) == 3.0 * P


def test_memory_strip_draws_measured_and_predicted_bytes(tmp_path: Path) -> None:
    _, timeline = simulated("1f1b")
    predicted = {r: activation_bytes_curve(timeline, r, [1024.0] * P) for r in range(P)}
    measured = {r: [(t, b * 0.5) for t, b in c] for r, c in predicted.items()}
    path = tmp_path / "memory.png"
    fig = strict(plot_timeline, timeline, path, activations=True, memory=MemoryCurves(measured, predicted))
    assert path.stat().st_size > 0 and len(fig.axes) == 2
    peaks = [t.get_text() for t in fig.axes[1].texts]
    assert peaks[0] == f"{0.5 * P:.1f}/{P:.1f} KiB"
    assert "measured (filled) and predicted (dashed)" in fig.axes[1].get_title(loc="left")
    alone = plot_timeline(timeline, None, activations=True, memory=MemoryCurves(measured))
    assert "predicted" not in alone.axes[1].get_title(loc="left")


def test_transfer_arrows_one_per_cross_rank_tensor() -> None:
    schedule, timeline = simulated("1f1b")
    assert len(transfer_pairs(timeline)) == 2 * (P - 1) * M
    fig = plot_timeline(timeline, None, transfers=schedule)
    assert len(arrows(fig)) == 2 * (P - 1) * M
    assert not arrows(plot_timeline(timeline, None))
    _, vshape = simulated("zbv")
    pairs = transfer_pairs(vshape)
    assert pairs and all(src.rank != dst.rank for src, dst, _ in pairs)
    assert len(pairs) == 2 * 2 * (P - 1) * M, "the turn of the V (stage P-1 -> P) stays on one rank"


def test_draws_into_given_axes() -> None:
    from matplotlib.figure import Figure

    timeline = hand_timeline([[("0F0", 0, 1), ("0B0", 3, 5)], [("1F0", 1, 2), ("1B0", 2, 3)]])
    fig = Figure()
    ax = fig.add_subplot()
    assert plot_timeline(timeline, ax) is None
    assert len(boxes(fig)) == 2 * 2
    with pytest.raises(ValueError, match="2 Axes"):
        plot_timeline(timeline, ax, activations=True)
    fig2 = Figure()
    pair = fig2.subplots(2, 1)
    assert plot_timeline(timeline, list(pair), activations=True) is None
    assert len(boxes(fig2)) == 4


def test_measured_timeline_in_seconds_starts_at_zero() -> None:
    _, sim = simulated("1f1b")
    measured = as_measured(sim, 0.002, origin=1234.5)
    fig = strict(plot_timeline, measured, None)
    assert fig.axes[0].get_xlabel() == "time (ms)"
    first = min(b.get_x() for b in boxes(fig))
    assert first == pytest.approx(0.0)
    assert max(b.get_x() + b.get_width() for b in boxes(fig)) == pytest.approx(sim.makespan * 2.0)
    assert "measured" in fig.texts[1].get_text()


def test_bad_input_raises_value_error(tmp_path: Path) -> None:
    _, timeline = simulated("1f1b")
    with pytest.raises(ValueError, match=r"'\.jpg'"):
        plot_timeline(timeline, tmp_path / "g.jpg")
    with pytest.raises(ValueError, match="no events"):
        plot_timeline(Timeline("empty", 2, 1, ()), tmp_path / "g.png")
    with pytest.raises(ValueError, match="Timeline"):
        plot_timeline("1f1b", tmp_path / "g.png")  # type: ignore[arg-type]


def test_headless_and_lazy_matplotlib(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import duplexpipe.viz as v\n"
        "assert 'matplotlib' not in sys.modules, 'imported eagerly'\n"
        "from duplexpipe.schedules.ir import parse_action\n"
        "from duplexpipe.schedules.timeline import Event, Timeline\n"
        "t = Timeline('x', 1, 1, (Event(0, parse_action('0F0'), 0, 1),))\n"
        f"v.plot_timeline(t, {str(tmp_path / 'h.png')!r})\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "MPLBACKEND")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "h.png").stat().st_size > 0


def test_labels_skip_boxes_hidden_by_the_next_and_stray_ranks_fail() -> None:
    # measured runs can overlap: 0F0's visible part (0..0.05 of 10) is too narrow for a label
    timeline = hand_timeline([[("0F0", 0, 6), ("0F1", 0.05, 6), ("0B0", 6, 10)]])
    fig = plot_timeline(timeline, None)
    assert sorted(t.get_text() for t in fig.axes[0].texts if t.get_text().isdigit()) == ["0", "1"]
    assert len(boxes(fig)) == 3
    stray = Timeline("x", 1, 1, hand_timeline([[], [("1F0", 0, 1)]]).events)
    with pytest.raises(ValueError, match=r"ranks \[1\], outside 0..0"):
        plot_timeline(stray, None)


def batched(fig: Any) -> list[Any]:
    """The batched box collections of a figure (large charts)."""
    return [c for ax in fig.axes for c in ax.collections if (c.get_gid() or "").startswith(f"{st.BOX_GID}es-")]


def test_large_timelines_are_batched_in_a_capped_figure() -> None:
    _, timeline = simulated("dualpipe", 16, 96)
    assert len(timeline.events) > DETAIL_LIMIT
    fig = strict(plot_timeline, timeline, None, activations=True)
    assert not boxes(fig), "no patch per box at this scale"
    (coll,) = batched(fig)
    parts = sum(len(e.action.compute_parts()) for e in timeline.events)
    assert len(coll.get_paths()) == parts, "one rectangle per action (two per F&B pair)"
    assert fig.get_size_inches()[1] <= 0.95 + MAX_GANTT_IN + 0.42 + MAX_ACT_IN + 0.5 + 0.01
    drawn = sorted((round(v[:, 0].min(), 6), round(v[:, 0].max(), 6), round(v[:, 1].min() + 0.4, 6))
                   for v in (p.vertices for p in coll.get_paths()))
    expected = sorted((round(e.start + i * e.duration / n, 6), round(e.start + (i + 1) * e.duration / n, 6),
                       float(e.rank))
                      for e in timeline.events for n in [len(e.action.compute_parts())] for i in range(n))
    assert drawn == expected, "every part at its time, in its rank's row"


def test_many_ranks_thin_the_labels_and_drop_the_activations_panel() -> None:
    _, timeline = simulated("1f1b", MAX_ACT_ROWS + 32, 2)
    fig = strict(plot_timeline, timeline, None, activations=True)
    assert len(fig.axes) == 1, "activations panel left out"
    assert f"left out above {MAX_ACT_ROWS} ranks" in fig.texts[1].get_text()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    step = int(labels[1].split()[1])
    assert step > 1 and labels == [f"rank {r}" for r in range(0, MAX_ACT_ROWS + 32, step)]
    shares = [t for t in fig.axes[0].texts if t.get_text().endswith("%")]
    assert len(shares) == len(labels), "one idle share per labelled row"


def test_ranks_and_window_select_what_is_drawn() -> None:
    _, timeline = simulated("1f1b")
    fig = strict(plot_timeline, timeline, None, activations=True, ranks=[3, 0], window=(10, 20))
    gantt, act = fig.axes
    assert [t.get_text() for t in gantt.get_yticklabels()] == ["rank 3", "rank 0"]
    assert gantt.get_xlim() == (10, 20) and act.get_xlim() == (10, 20)
    drawn = {b.get_gid(): b for b in boxes(fig)}
    expected = [e for e in timeline.events if e.rank in (3, 0) and e.end >= 10 and e.start <= 20]
    assert len(drawn) == len(expected) > 0
    for e in expected:
        box = drawn[f"{st.BOX_GID}-0-r{e.rank}-s{e.action.stage}{e.action.op.value}m{e.action.microbatch}"]
        assert box.get_y() == pytest.approx((0 if e.rank == 3 else 1) - 0.4)
    assert any(line.get_linestyle() == "--" for line in gantt.lines), "a dashed line where ranks are skipped"
    assert [t.get_text() for t in act.texts if t.get_text().startswith("peak")] == [
        f"peak {timeline.peak_activations(3)}", f"peak {timeline.peak_activations(0)}"]
    assert "2 of 4 ranks shown" in fig.texts[1].get_text() and "window 10:20" in fig.texts[1].get_text()


def test_a_window_into_a_large_chart_labels_the_boxes_again() -> None:
    _, timeline = simulated("dualpipe", 16, 96)
    whole = plot_timeline(timeline, None)
    assert not [t for t in whole.axes[0].texts if t.get_text().isdigit()], "boxes too small to label"
    zoom = plot_timeline(timeline, None, ranks=range(4), window=(40, 60))
    labels = [t for t in zoom.axes[0].texts if t.get_text().isdigit()]
    assert labels and all(40 - 3 <= t.get_position()[0] <= 60 + 3 for t in labels)
    assert len(boxes(zoom)) == sum(1 for e in timeline.events if e.rank < 4 and e.end >= 40 and e.start <= 60)


@pytest.mark.parametrize("ranks,window,needle", [
    ([4], None, r"rank\(s\) \[4\]"), ([], None, "empty"), ([1, 1], None, "repeat"), (None, (5, 5), "before"),
    (None, (1000, None), "shows nothing"), (None, (None, -1), "shows nothing"), (None, (0, float("nan")), "finite"),
])
def test_bad_views_raise_value_error(ranks: Any, window: Any, needle: str) -> None:
    _, timeline = simulated("1f1b")
    with pytest.raises(ValueError, match=needle):
        plot_timeline(timeline, None, ranks=ranks, window=window)
