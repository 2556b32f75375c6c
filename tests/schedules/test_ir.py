"""Tests of the IR (text, JSON and torch CSV forms, malformed input) and of Timeline's metrics."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import (
    FSDP_OPS,
    NO_MICROBATCH,
    Action,
    Op,
    Schedule,
    StageInfo,
    format_action,
    json_header,
    load_json,
    load_torch_csv,
    parse_action,
    rows_to_csv,
    save_json,
    save_torch_csv,
)
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.timeline import Event, Timeline
from duplexpipe.schedules.verify import verify

PLAIN_OPS = [op for op in Op if op is not Op.OVERLAP_F_B and not op.is_fsdp]
plain_actions = st.builds(Action, st.integers(0, 999), st.sampled_from(PLAIN_OPS), st.integers(0, 9999))
stage_actions = st.builds(Action.on_stage, st.integers(0, 999), st.sampled_from(sorted(FSDP_OPS)))
pairs = st.builds(Action.overlap, st.builds(Action, st.integers(0, 99), st.just(Op.F), st.integers(0, 999)),
                  st.builds(Action, st.integers(0, 99), st.sampled_from([Op.B, Op.I]), st.integers(0, 999)))
actions = st.one_of(plain_actions, stage_actions, pairs)


@given(actions)
def test_format_parse_round_trip(action: Action) -> None:
    text = format_action(action)
    assert parse_action(text) == action
    assert parse_action(f"  {text} ") == action
    assert str(action) == text


def test_text_forms_match_torch() -> None:
    assert format_action(Action(2, Op.F, 0)) == "2F0"
    assert format_action(Action(1, Op.SEND_F, 4)) == "1SEND_F4"
    pair = Action.overlap(Action(0, Op.F, 7), Action(7, Op.B, 3))
    assert format_action(pair) == "(0F7;7B3)OVERLAP_F_B"
    assert (pair.stage, pair.microbatch) == (0, 7)
    assert pair.compute_parts() == (Action(0, Op.F, 7), Action(7, Op.B, 3))


@pytest.mark.parametrize("token", ["", "F0", "0X0", "0F", "-1F0", "0F0x", "(0F0)OVERLAP_F_B",
                                   "(0B0;1F0)OVERLAP_F_B", "(0F0;1W0)OVERLAP_F_B", "(0F0;1B0)"])
def test_bad_tokens_raise_naming_the_token(token: str) -> None:
    with pytest.raises(ScheduleError) as err:
        parse_action(token)
    assert repr(token.strip()) in str(err.value)


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    ranks = draw(st.integers(1, 4))
    stages = tuple(StageInfo(rank=s % ranks, group=s) for s in range(ranks * draw(st.integers(1, 2))))
    rows = tuple(tuple(draw(st.lists(actions, max_size=6))) for _ in range(ranks))
    return Schedule(draw(st.text(min_size=1, max_size=8)), ranks, draw(st.integers(1, 9)), stages, rows)


@settings(max_examples=50)
@given(schedules())
def test_json_round_trip_of_any_schedule(schedule: Schedule) -> None:
    text = json.dumps(schedule.to_dict())
    back = Schedule.from_dict(json.loads(text))
    assert back == schedule
    assert back.fingerprint() == schedule.fingerprint()


@pytest.mark.parametrize("name", ["1f1b", "dualpipe", "zbv", "interleaved-1f1b"])
def test_json_file_round_trip(tmp_path: Path, name: str) -> None:
    for schedule in (registry.build(name, 4, 8), lower(registry.build(name, 4, 8))):
        path = tmp_path / "s.json"
        save_json(schedule, str(path))
        assert load_json(str(path)) == schedule


def test_fingerprint_changes_with_the_plan() -> None:
    a = registry.build("1f1b", 4, 8)
    swapped = list(a.actions[0])
    swapped[0], swapped[1] = swapped[1], swapped[0]
    b = Schedule(a.name, a.num_ranks, a.num_microbatches, a.stages, (tuple(swapped),) + a.actions[1:])
    assert a.fingerprint() != b.fingerprint()


GOOD = {"format": "duplexpipe-schedule", "version": 1, "name": "x", "num_ranks": 1, "num_microbatches": 1,
        "stages": [{"rank": 0, "group": 0}], "actions": [["0F0", "0B0"]]}


@pytest.mark.parametrize("change,needle", [
    ({"format": "other"}, "'format'"),
    ({"version": 2}, "version 2"),
    ({"num_ranks": "1"}, "'num_ranks'"),
    ({"stages": [{"rank": 0}]}, "'group'"),
    ({"stages": [{"rank": 3, "group": 0}]}, "rank 3"),
    ({"actions": [["0F0", "0Z0"]]}, "rank 0, position 1"),
    ({"actions": [["0F0", 5]]}, "5"),
    ({"actions": [["0F0"], ["0B0"]]}, "expected 1 action lists"),
    ({"actions": [["0F0"] * 17]}, "17 actions, more than the 16 a schedule of 1 stages and 1 microbatches can hold"),
])
def test_malformed_json_names_the_problem(tmp_path: Path, change: dict, needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(ScheduleError) as err:
        load_json(str(path))
    assert needle in str(err.value) and str(err.value).startswith(f"{path}: "), err.value  # names the file


def test_a_csv_with_a_bad_stage_table_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "two.csv"
    path.write_text("0F0,0B0\n")
    with pytest.raises(ScheduleError, match=rf"^{path}: num_microbatches must be >= 1, got 0"):
        load_torch_csv(str(path), num_microbatches=0)


def test_schedule_files_over_the_limit_are_refused_before_they_are_read(tmp_path: Path) -> None:
    for name in ("huge.json", "huge.csv"):
        with open(tmp_path / name, "wb") as fh:
            fh.truncate(200 * 2**20)  # sparse: 200 MB on paper
        load = load_json if name.endswith(".json") else load_torch_csv
        with pytest.raises(ScheduleError, match=r"is 209,715,200 bytes, over the 128 MiB limit for a schedule file"):
            load(str(tmp_path / name))


def test_the_header_states_p_and_m_before_the_actions(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    save_json(registry.build("1f1b", 3, 5), str(path))
    assert json_header(str(path)) == (3, 5)
    path.write_text('{"actions": [], "num_ranks": 3, "num_microbatches": 5}')  # after the actions: not read
    assert json_header(str(path)) == (None, None)


def test_json_that_is_not_json_or_missing(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{nope")
    with pytest.raises(ScheduleError, match="not valid JSON"):
        load_json(str(path))
    with pytest.raises(ScheduleError, match="cannot read"):
        load_json(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b", "zbv", "dualpipev"])
@pytest.mark.parametrize("comms", [False, True])
def test_torch_csv_round_trip(tmp_path: Path, name: str, comms: bool) -> None:
    schedule = registry.build(name, 4, 8)
    schedule = lower(schedule) if comms else schedule
    path = tmp_path / "s.csv"
    save_torch_csv(schedule, str(path))
    back = load_torch_csv(str(path), name=name)
    assert back.actions == schedule.actions
    assert back.stages == schedule.stages
    assert back.num_microbatches == schedule.num_microbatches
    assert path.read_text() == rows_to_csv(schedule.actions)


@pytest.mark.parametrize("content,needles", [
    ("0F0,0B0\n1F0,1X0\n", ["line 2", "rank 1", "1X0"]),
    ("0F0,(0F1;1Q0)OVERLAP_F_B\n", ["line 1", "(0F1;1Q0)OVERLAP_F_B"]),
    ("0F0,0B0\n0F1,1F0\n", ["stage 0", "rank 0", "rank 1"]),
    ("0F0\n2F0\n", ["stages [1]"]),
    ("", ["no rows"]),
])
def test_malformed_csv_names_line_rank_and_token(tmp_path: Path, content: str, needles: list[str]) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ScheduleError) as err:
        load_torch_csv(str(path))
    for needle in needles:
        assert needle in str(err.value)


def _torch_schedule(name: str, ranks: int, microbatches: int) -> object:
    """Instantiate one of torch's multi-stage schedule classes on mocked stages (2 per rank)."""
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, ranks, None, 2 * ranks
    return get_schedule_class(name)([stage, stage], microbatches)


@pytest.mark.parametrize("torch_name", ["DualPipeV", "Interleaved1F1B"])
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8), (4, 12)])
def test_import_csv_written_by_torch(tmp_path: Path, torch_name: str, fmt: str, ranks: int,
                                     microbatches: int) -> None:
    path = tmp_path / f"{torch_name}.csv"
    _torch_schedule(torch_name, ranks, microbatches)._dump_csv(str(path), format=fmt)  # type: ignore[attr-defined]
    schedule = load_torch_csv(str(path), name=torch_name)
    assert schedule.num_ranks == ranks and schedule.num_stages == 2 * ranks
    assert schedule.num_microbatches == microbatches
    assert schedule.has_comms == (fmt == "compute_comms")
    verify(schedule)
    if torch_name == "DualPipeV":
        assert [s.rank for s in schedule.stages] == [s if s < ranks else 2 * ranks - 1 - s
                                                     for s in range(2 * ranks)]
    else:
        assert [s.rank for s in schedule.stages] == [s % ranks for s in range(2 * ranks)]


def test_torch_dualpipev_matches_ours(tmp_path: Path) -> None:
    path = tmp_path / "dpv.csv"
    _torch_schedule("DualPipeV", 4, 8)._dump_csv(str(path), format="compute_only")  # type: ignore[attr-defined]
    assert load_torch_csv(str(path)).actions == registry.build("dualpipev", 4, 8).actions


def _timeline(*events: tuple[int, str, float, float]) -> Timeline:
    return Timeline("t", 2, 2, tuple(Event(r, parse_action(a), s, e) for r, a, s, e in events))


def test_timeline_busy_idle_and_bubble() -> None:
    tl = _timeline((0, "0F0", 1.0, 2.0), (0, "0F1", 2.0, 3.0), (0, "0B0", 5.0, 7.0),
                   (1, "1F0", 2.0, 3.0), (1, "1B0", 2.5, 4.0))
    assert tl.start == 1.0 and tl.makespan == 6.0
    assert tl.busy(0) == 4.0 and tl.idle(0) == 2.0
    assert tl.busy(1) == 2.0 and tl.idle(1) == 4.0  # the overlap [2.5, 3] counts once
    assert tl.bubble_ratio == pytest.approx(6.0 / 12.0)
    assert [e.action for e in tl.rank_events(1)] == [Action(1, Op.F, 0), Action(1, Op.B, 0)]
    assert Event(0, Action(0, Op.F, 0), 1.0, 2.5).duration == 1.5


def test_timeline_activations() -> None:
    tl = _timeline((0, "0F0", 0.0, 1.0), (0, "0F1", 1.0, 2.0), (0, "0I0", 2.0, 3.0),
                   (0, "0B1", 3.0, 5.0), (0, "0W0", 5.0, 6.0), (0, "0F2", 6.0, 7.0),
                   (1, "(1F0;1B2)OVERLAP_F_B", 0.0, 3.0))
    # I does not free the activation, W does; the release at t=5 comes before nothing else
    assert tl.activation_curve(0) == [(0.0, 1), (1.0, 2), (5.0, 1), (6.0, 0), (6.0, 1)]
    assert tl.peak_activations(0) == 2
    assert tl.activation_curve(1) == [(0.0, 1), (3.0, 0)]
    assert Timeline("e", 1, 1, ()).makespan == 0.0 and Timeline("e", 1, 1, ()).bubble_ratio == 0.0


def test_timeline_dict_round_trip_and_errors() -> None:
    tl = _timeline((0, "0F0", 0.0, 1.0), (1, "(1F0;1B2)OVERLAP_F_B", 1.0, 3.0))
    assert Timeline.from_dict(json.loads(json.dumps(tl.to_dict()))) == tl
    with pytest.raises(ScheduleError, match="malformed timeline"):
        Timeline.from_dict({"schedule": "x", "ranks": 1, "microbatches": 1, "events": [[0, "0Q0", 0, 1]]})
    with pytest.raises(ScheduleError, match="malformed timeline"):
        Timeline.from_dict({"schedule": "x"})


def test_stage_actions_take_no_microbatch() -> None:
    assert format_action(Action.on_stage(3, Op.UNSHARD)) == "3UNSHARD"
    assert parse_action("12REDUCE_GRAD") == Action(12, Op.REDUCE_GRAD, NO_MICROBATCH)
    assert {op.value for op in FSDP_OPS} == {"UNSHARD", "RESHARD", "REDUCE_GRAD"}
    with pytest.raises(ScheduleError, match="RESHARD acts on a whole stage and takes no microbatch"):
        parse_action("0RESHARD2")
    with pytest.raises(ValueError, match="F acts on a microbatch"):
        Action.on_stage(0, Op.F)


def test_stage_actions_read_by_torch() -> None:
    from torch.distributed.pipelining.schedules import _Action

    for op in sorted(FSDP_OPS):
        text = format_action(Action.on_stage(5, op))
        theirs = _Action.from_str(text)
        assert (theirs.stage_index, theirs.computation_type.value, theirs.microbatch_index) == (5, op.value, None)
        assert repr(theirs) == text


@pytest.mark.parametrize("name", ["1f1b", "zbv", "interleaved-1f1b", "dualpipev", "dualpipe"])
@pytest.mark.parametrize("lowered", [False, True])
def test_sharded_schedules_round_trip_json_and_torch_csv(tmp_path: Path, name: str, lowered: bool) -> None:
    from duplexpipe.schedules.shard import add_unshard_reshard

    base = registry.build(name, 2, 4)
    schedule = add_unshard_reshard(lower(base) if lowered else base, 1, 1)
    save_json(schedule, str(tmp_path / "s.json"))
    assert load_json(str(tmp_path / "s.json")) == schedule
    if schedule.num_copies > 1:
        return  # a torch CSV has no stage table for two model copies
    save_torch_csv(schedule, str(tmp_path / "s.csv"))
    back = load_torch_csv(str(tmp_path / "s.csv"), name=schedule.name, num_microbatches=4)
    assert back.actions == schedule.actions and back.stages == schedule.stages
    def parts(s: Schedule) -> list[list[Action]]:  # a window of 1 runs DualPipeV's F&B pairs as their parts
        return [[p for a in row for p in a.compute_parts()] for row in s.actions]
    assert back.has_fsdp and parts(back.without_fsdp()) == parts(lower(base) if lowered else base)
    verify(back)
