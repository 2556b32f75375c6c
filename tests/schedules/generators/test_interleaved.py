"""Tests for Megatron's interleaved 1F1B generator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from duplexpipe.schedules.generators.interleaved import interleaved_1f1b
from duplexpipe.schedules.ir import Op, format_action


def test_stage_table_and_chunk_order() -> None:
    s = interleaved_1f1b(4, 8, chunks=2)
    assert s.num_stages == 8 and [info.rank for info in s.stages] == [0, 1, 2, 3] * 2
    row = s.actions[0]
    # Rank 0 warms up with 2(P-1) + (v-1)P = 10 forwards: a round of P on chunk 0, then chunk 1, ...
    assert [format_action(a) for a in row[:10]] == [
        "0F0", "0F1", "0F2", "0F3", "4F0", "4F1", "4F2", "4F3", "0F4", "0F5"]
    assert [format_action(a) for a in row[10:13]] == ["0F6", "4B0", "0F7"]


@pytest.mark.parametrize(("ranks", "mbs", "chunks"), [(4, 8, 2), (2, 6, 3), (3, 3, 2), (4, 12, 4)])
def test_warmup_counts_and_backward_order(ranks: int, mbs: int, chunks: int) -> None:
    s = interleaved_1f1b(ranks, mbs, chunks)
    for rank, row in enumerate(s.actions):
        warmup = min(2 * (ranks - 1 - rank) + (chunks - 1) * ranks, mbs * chunks)
        first_b = next(i for i, a in enumerate(row) if a.op is Op.B)
        assert first_b == (warmup + 1 if warmup < mbs * chunks else warmup)
        backwards = [a for a in row if a.op is Op.B]
        # The first round of backwards runs on the last chunk, microbatches 0..P-1.
        assert [(a.stage, a.microbatch) for a in backwards[:ranks]] == [
            ((chunks - 1) * ranks + rank, m) for m in range(ranks)]


@pytest.mark.parametrize(("ranks", "mbs", "chunks", "needle"), [
    (4, 6, 2, "multiple of num_ranks, got num_microbatches=6, num_ranks=4"),
    (4, 8, 1, "chunks >= 2, got chunks=1"),
    (1, 4, 2, "num_ranks >= 2, got num_ranks=1"),
    (2, 4, "2", "integer chunks, got chunks='2'"),
])
def test_bad_arguments(ranks: int, mbs: int, chunks: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        interleaved_1f1b(ranks, mbs, chunks)  # type: ignore[arg-type]


def test_matches_torch_interleaved_1f1b_order() -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for ranks, mbs, chunks in ((2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 9, 2)):
        fake = SimpleNamespace(pp_group_size=ranks, _n_microbatches=mbs, n_local_stages=chunks,
                               microbatches_per_round=ranks)
        try:
            theirs = [[str(a) for a in schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(
                fake, r) if a is not None] for r in range(ranks)]
        except (AttributeError, TypeError) as exc:
            pytest.skip(f"torch's interleaved order is not available: {exc}")
        ours = [[format_action(a) for a in row] for row in interleaved_1f1b(ranks, mbs, chunks).actions]
        assert ours == theirs
