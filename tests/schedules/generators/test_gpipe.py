"""Tests for the GPipe generator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from duplexpipe.schedules.generators.gpipe import gpipe
from duplexpipe.schedules.ir import Op, StageInfo, format_action


def test_all_forwards_then_all_backwards_in_order() -> None:
    s = gpipe(3, 5)
    assert s.name == "gpipe" and s.stages == tuple(StageInfo(r, r) for r in range(3))
    for rank, row in enumerate(s.actions):
        assert [a.op for a in row] == [Op.F] * 5 + [Op.B] * 5
        assert [a.microbatch for a in row] == [0, 1, 2, 3, 4] * 2
        assert {a.stage for a in row} == {rank}


def test_one_rank_is_allowed() -> None:
    assert [format_action(a) for a in gpipe(1, 2).actions[0]] == ["0F0", "0F1", "0B0", "0B1"]


@pytest.mark.parametrize(("ranks", "mbs", "needle"), [
    (0, 4, "num_ranks >= 1, got num_ranks=0"),
    (2, 0, "num_microbatches >= 1, got num_microbatches=0"),
    (2.0, 4, "integer num_ranks, got num_ranks=2.0"),
    (2, True, "integer num_microbatches, got num_microbatches=True"),
])
def test_bad_arguments(ranks: object, mbs: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        gpipe(ranks, mbs)  # type: ignore[arg-type]


def test_matches_torch_gpipe_order() -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for ranks, mbs in ((2, 3), (4, 8), (5, 2)):
        fake = SimpleNamespace(_num_stages=ranks, _n_microbatches=mbs)
        try:
            order = schedules.ScheduleGPipe._get_pipeline_order(fake)
        except (AttributeError, TypeError) as exc:  # a torch without this private helper
            pytest.skip(f"torch's GPipe order is not available: {exc}")
        theirs = [[str(a) for a in order[r] if a is not None and a.is_compute_op] for r in range(ranks)]
        assert [[format_action(a) for a in row] for row in gpipe(ranks, mbs).actions] == theirs
