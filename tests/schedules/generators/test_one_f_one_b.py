"""Tests for the 1F1B generator."""

from __future__ import annotations

import pytest

from duplexpipe.schedules.generators.one_f_one_b import one_f_one_b
from duplexpipe.schedules.ir import Op, format_action


def live_peak(row: tuple) -> int:
    """Most forwards whose backward has not run yet, along one list."""
    live = peak = 0
    for a in row:
        live += 1 if a.op is Op.F else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(("ranks", "mbs"), [(4, 8), (4, 2), (6, 7), (3, 1)])
def test_warmup_and_memory(ranks: int, mbs: int) -> None:
    s = one_f_one_b(ranks, mbs)
    for rank, row in enumerate(s.actions):
        warmup = min(ranks - 1 - rank, mbs)
        first_b = next(i for i, a in enumerate(row) if a.op is Op.B)
        assert first_b == warmup + 1 if warmup < mbs else first_b == mbs
        assert live_peak(row) == min(ranks - rank, mbs)
        assert [a.microbatch for a in row if a.op is Op.F] == list(range(mbs))
        assert [a.microbatch for a in row if a.op is Op.B] == list(range(mbs))


def test_steady_state_alternates() -> None:
    row = one_f_one_b(4, 8).actions[1]
    steady = [format_action(a) for a in row[2:12]]
    assert steady == ["1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1F5", "1B3", "1F6", "1B4"]


def test_last_rank_never_waits_two_forwards() -> None:
    row = one_f_one_b(5, 6).actions[4]
    assert [a.op for a in row] == [Op.F, Op.B] * 6


@pytest.mark.parametrize(("ranks", "mbs", "needle"), [
    (0, 4, "1f1b needs num_ranks >= 1, got num_ranks=0"),
    (4, -1, "num_microbatches >= 1, got num_microbatches=-1"),
    ("4", 4, "integer num_ranks, got num_ranks='4'"),
])
def test_bad_arguments(ranks: object, mbs: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        one_f_one_b(ranks, mbs)  # type: ignore[arg-type]

