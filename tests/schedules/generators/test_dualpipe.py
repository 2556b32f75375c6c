"""Tests for the DualPipe and DualPipeV generators against DeepSeek's eight-step order."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from duplexpipe.schedules.generators.dualpipe import dualpipe, dualpipev
from duplexpipe.schedules.ir import Action, format_action


def texts(row: tuple[Action, ...]) -> list[str]:
    return [format_action(a) for a in row]


def pair(f: str, b: str) -> str:
    return f"({f};{b})OVERLAP_F_B"


def test_dualpipe_stage_table() -> None:
    s = dualpipe(4, 8)
    assert [(i.rank, i.group) for i in s.stages] == [
        (0, 0), (1, 1), (2, 2), (3, 3), (3, 0), (2, 1), (1, 2), (0, 3)]
    assert s.num_copies == 2 and list(s.microbatches_of_stage(7)) == [4, 5, 6, 7]


def test_dualpipe_rank0_follows_the_steps() -> None:
    # P=4, M=8: n=2, h=0, C=4; phase 0 = stage 0 (mb 0..3), phase 1 = stage 7 (mb 4..7).
    assert texts(dualpipe(4, 8).actions[0]) == [
        "0F0", "0F1",  # 1: F0 x 2(n-h-1)
        "0F2", "7F4",  # 2: F0 F1 x (h+1)
        "7I4", "7W4", "7F5",  # 3: I1 W F1 x (n-h-1)
        pair("0F3", "7B5"), pair("7F6", "0B0"),  # 4: x (C-2n+h+1)
        "7B6", pair("7F7", "0B1"),  # 5: x (n-h-1)
        "7B7", "0I2",  # 6: h even, split from this B0 on
        "0W2", "0I3",  # 7: W I0
        "0W3",  # 8: W
    ]


def test_dualpipe_middle_rank_does_not_overlap_its_first_pair() -> None:
    # Rank 1 of 4 is a middle rank (h = n-1 = 1): phase 0 = stage 1 (mb 0..3), phase 1 = stage 6 (mb 4..7).
    assert texts(dualpipe(4, 8).actions[1]) == [
        "1F0", "6F4", "1F1", "6F5",  # 2
        "1F2", "6B4", pair("6F6", "1B0"), pair("1F3", "6B5"), pair("6F7", "1B1"),  # 4, first not overlapped
        "6B6", "1B2", "6I7", "1I3",  # 6: h odd, split from the second B1 on
        "6W7", "1W3",  # 8
    ]


def test_dualpipe_two_ranks() -> None:
    assert [texts(row) for row in dualpipe(2, 4).actions] == [
        ["0F0", "3F2", "0F1", "3B2", pair("3F3", "0B0"), "3B3", "0I1", "0W1"],
        ["2F2", "1F0", "2F3", "1B0", pair("1F1", "2B2"), "1B1", "2I3", "2W3"],
    ]


@pytest.mark.parametrize(("rank", "tail"), [
    (0, ["11B11", "0I3", "0W3", "0I4", "0W4", "0I5", "0W5"]),  # h=0
    (1, ["10B10", "1B3", "10I11", "1I4", "10W11", "1I5", "1W4", "1W5"]),  # h=1: W takes the oldest
    (2, ["9B9", "2B3", "9B10", "2I4", "9I11", "2I5", "2W4", "9W11", "2W5"]),  # h=2, middle
])
def test_dualpipe_split_backwards_and_oldest_weight_first(rank: int, tail: list[str]) -> None:
    row = texts(dualpipe(6, 12).actions[rank])
    assert row[-len(tail):] == tail
    if rank == 2:
        assert row[6:9] == ["2F3", "9B6", pair("9F9", "2B0")]


@pytest.mark.parametrize(("ranks", "mbs"), [(2, 4), (4, 8), (6, 14), (8, 16)])
def test_dualpipe_ranks_mirror_each_other(ranks: int, mbs: int) -> None:
    """Rank P-1-r runs rank r's order with the copies (stage +-P, microbatch +-M/2) swapped."""
    s = dualpipe(ranks, mbs)

    def swap(a: Action) -> Action:
        return Action((a.stage + ranks) % (2 * ranks), a.op, (a.microbatch + mbs // 2) % mbs)

    for rank in range(ranks):
        mirrored = [Action.overlap(*map(swap, a.parts)) if a.parts else swap(a) for a in s.actions[rank]]
        assert mirrored == list(s.actions[ranks - 1 - rank])


def test_dualpipev_rank0_follows_the_steps() -> None:
    # P=4, M=8: n=4, h=0, C=8; stage 0 (phase 0) and stage 7 (phase 1), every microbatch.
    s = dualpipev(4, 8)
    assert [i.rank for i in s.stages] == [0, 1, 2, 3, 3, 2, 1, 0] and s.num_copies == 1
    assert texts(s.actions[0]) == (
        [f"0F{m}" for m in range(6)] + ["0F6", "7F0"]
        + ["7I0", "7W0", "7F1", "7I1", "7W1", "7F2", "7I2", "7W2", "7F3"]
        + [pair("0F7", "7B3"), pair("7F4", "0B0")]
        + ["7B4", pair("7F5", "0B1"), "7B5", pair("7F6", "0B2"), "7B6", pair("7F7", "0B3")]
        + ["7B7", "0I4"] + ["0W4", "0I5", "0W5", "0I6", "0W6", "0I7"] + ["0W7"]
    )


def test_dualpipev_last_rank_is_the_middle_rank() -> None:
    row = texts(dualpipev(3, 6).actions[2])
    # Steps 1 and 3 are empty on rank P-1; step 2 runs F0 F1 three times, then step 4 starts unpaired.
    assert row[:9] == ["2F0", "3F0", "2F1", "3F1", "2F2", "3F2", "2F3", "3B0", pair("3F3", "2B0")]


@pytest.mark.parametrize(("ranks", "mbs"), [(2, 4), (3, 6), (4, 8), (4, 11), (6, 20)])
def test_dualpipev_matches_torch(ranks: int, mbs: int) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    fake = SimpleNamespace(pp_group_size=ranks, _n_microbatches=mbs)
    try:
        method = schedules.ScheduleDualPipeV._calculate_single_rank_operations
        theirs = [[str(a) for a in method(fake, r)] for r in range(ranks)]
    except (AttributeError, TypeError) as exc:
        pytest.skip(f"torch's DualPipeV order is not available: {exc}")
    assert [texts(row) for row in dualpipev(ranks, mbs).actions] == theirs


@pytest.mark.parametrize(("fn", "ranks", "mbs", "needle"), [
    (dualpipe, 3, 12, "dualpipe needs an even number of ranks, got num_ranks=3"),
    (dualpipe, 4, 9, "dualpipe needs an even number of microbatches, got num_microbatches=9"),
    (dualpipe, 4, 6, "dualpipe needs num_microbatches >= 2 \\* num_ranks, got num_microbatches=6, num_ranks=4"),
    (dualpipe, 0, 4, "dualpipe needs num_ranks >= 2, got num_ranks=0"),
    (dualpipev, 4, 7, "dualpipev needs num_microbatches >= 2 \\* num_ranks, got num_microbatches=7"),
    (dualpipev, 1, 4, "dualpipev needs num_ranks >= 2, got num_ranks=1"),
    (dualpipev, None, 4, "dualpipev needs an integer num_ranks, got num_ranks=None"),
])
def test_bad_arguments(fn: Any, ranks: object, mbs: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        fn(ranks, mbs)
