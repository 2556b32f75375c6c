"""Tests of the text views: the schedule grid round-trips its actions, the timeline rows keep time."""

from __future__ import annotations

import pytest
from _viz_cases import P, hand_timeline, schedule_names, simulated

from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Action, Schedule, parse_action
from duplexpipe.schedules.lower import lower
from duplexpipe.viz._style import short_token
from duplexpipe.viz.text import render_text


def parse_token(token: str) -> Action:
    parts = token.split("&")
    return Action.overlap(*map(parse_action, parts)) if len(parts) == 2 else parse_action(token)


def grid_rows(text: str, num_ranks: int) -> list[list[str]]:
    """The tokens of each rank, joined over wrapped blocks."""
    rows: list[list[str]] = [[] for _ in range(num_ranks)]
    for line in text.splitlines():
        if line.startswith("rank "):
            words = line.split()
            rows[int(words[1])] += words[2:]
    return rows


@pytest.mark.parametrize("name", schedule_names())
def test_grid_round_trips_every_schedule(name: str) -> None:
    schedule = registry.build(name, P, 8)
    text = render_text(schedule)
    rows = grid_rows(text, P)
    assert [tuple(map(parse_token, row)) for row in rows] == list(schedule.actions)
    lines = [line for line in text.splitlines() if line.startswith("rank ")]
    assert len(lines) == P
    assert len(text.splitlines()[0]) < 120 and "microbatches" in text.splitlines()[0]


def test_dualpipe_grid_is_compact_and_aligned() -> None:
    schedule = registry.build("dualpipe", 4, 8)
    text = render_text(schedule)
    assert max(len(line) for line in text.splitlines()) <= 200
    assert grid_rows(text, 4)[0][7] == "0F3&7B5" and grid_rows(text, 4)[3][10] == "3F3&4B5"
    rows = [line for line in text.splitlines() if line.startswith(("rank", "step"))]
    # every column starts at the same offset on every row
    starts = [{i for i, ch in enumerate(line) if ch != " " and (i == 0 or line[i - 1] == " ")} for line in rows]
    longest = max(starts, key=len)
    assert all(s <= longest for s in starts)


DUALPIPE_2x4 = """\
DualPipe · 2 ranks · 4 microbatches · 4 stages (2 copies) · compute only

step    0   1   2   3   4       5   6   7
rank 0  0F0 3F2 0F1 3B2 3F3&0B0 3B3 0I1 0W1
rank 1  2F2 1F0 2F3 1B0 1F1&2B2 1B1 2I3 2W3

key: F forward, B backward, I input-grad, W weight-grad; a&b = an overlapped F&B pair (OVERLAP_F_B)"""
"""The whole grid of a small DualPipe: an F&B pair is one cell `F&B`, its column as wide as the pair."""


def test_a_small_dualpipe_grid_is_exactly_this_text() -> None:
    assert render_text(registry.build("dualpipe", 2, 4)) == DUALPIPE_2x4 + "\n"


def test_grid_with_comms_and_wrapping() -> None:
    schedule = lower(registry.build("1f1b", P, 8))
    text = render_text(schedule, width=80)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert text.count("step") > 1, "wrapped into several blocks"
    rows = grid_rows(text, P)
    assert [tuple(map(parse_action, row)) for row in rows] == list(schedule.actions)
    assert "SEND_F" in text and "RECV_B" in text and "with comms" in text


def timeline_bodies(text: str) -> list[str]:
    """The time-axis part of each rank row."""
    bodies = []
    for line in text.splitlines():
        if line.startswith("rank "):
            body = line.split(None, 2)[2]
            bodies.append(body[: body.rindex("  ")])
    return bodies


def test_timeline_rows_are_time_ordered_with_idle_dots() -> None:
    _, timeline = simulated("1f1b")
    text = render_text(timeline)
    bodies = timeline_bodies(text)
    assert len(bodies) == P and len({len(b) for b in bodies}) == 1
    per_unit = len(bodies[0]) / timeline.makespan
    for r, body in enumerate(bodies):
        assert body.count(".") == pytest.approx(timeline.idle(r) * per_unit)
        labels = [piece.strip(". ") for piece in body.split("|") if piece.strip(". ")]
        assert labels == [short_token(e.action) for e in timeline.rank_events(r)]
        assert text.splitlines()[3 + r].endswith(f"{timeline.idle(r) / timeline.makespan:.1%}")
    assert f"bubble {timeline.bubble_ratio:.1%}" in text.splitlines()[0]


@pytest.mark.parametrize("name", ["dualpipe", "zbv", "interleaved-1f1b"])
def test_timeline_fits_the_width(name: str) -> None:
    _, timeline = simulated(name)
    for width in (None, 100):
        text = render_text(timeline, width=width)
        limit = 200 if width is None else width
        assert max(len(line) for line in text.splitlines()[:3 + P]) <= limit
        assert len(timeline_bodies(text)) == P


def test_short_events_and_bad_input() -> None:
    timeline = hand_timeline([[("0F0", 0, 0.01), ("(0F1;1B0)OVERLAP_F_B", 0.01, 0.02), ("0W0", 0.02, 10)]])
    text = render_text(timeline)
    body = timeline_bodies(text)[0]
    assert body[0] == "F" and body[1] == "X" and body.endswith("|")
    with pytest.raises(ValueError, match="Schedule or a Timeline"):
        render_text("1f1b")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="width must be >= 40"):
        render_text(registry.build("1f1b", 2, 2), width=10)
    assert isinstance(registry.build("1f1b", 2, 2), Schedule)
