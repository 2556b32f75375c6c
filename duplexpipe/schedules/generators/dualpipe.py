"""DualPipe and DualPipeV (DeepSeek-V3): bidirectional pipelines with overlapped forward-backward pairs."""

from __future__ import annotations

from dataclasses import dataclass

from duplexpipe.schedules.generators._common import RowBuilder, dual_stages, require_counts, v_stages
from duplexpipe.schedules.ir import Action, Schedule

DUALPIPE = "dualpipe"
DUALPIPEV = "dualpipev"


@dataclass(frozen=True)
class DualRank:
    """What one rank needs to lay out DeepSeek's eight steps."""

    n: int
    """Half the pipeline depth: P/2 for DualPipe, P for DualPipeV."""
    h: int
    """Distance from the nearer pipeline end: min(r, P-1-r) for DualPipe, r for DualPipeV."""
    chunks: int
    """Microbatches per phase C: M/2 for DualPipe, M for DualPipeV."""
    stage0: int
    """The stage this rank runs in phase 0 (the direction entering nearer to it)."""
    stage1: int
    """The stage this rank runs in phase 1 (the other direction)."""
    microbatches0: range
    """The microbatches of phase 0, in the order they are processed."""
    microbatches1: range
    """The microbatches of phase 1, in the order they are processed."""


def dual_row(spec: DualRank) -> tuple[Action, ...]:
    """One rank's computation order, DeepSeek's steps 1 to 8 (see docs/design.md)."""
    n, h, s0, s1 = spec.n, spec.h, spec.stage0, spec.stage1
    b = RowBuilder({s0: spec.microbatches0, s1: spec.microbatches1})
    for _ in range(2 * (n - h - 1)):  # 1: F0
        b.forward(s0)
    for _ in range(h + 1):  # 2: F0 F1
        b.forward(s0)
        b.forward(s1)
    for _ in range(n - h - 1):  # 3: I1 W F1
        b.backward(s1, split=True)
        b.weight()
        b.forward(s1)
    for i in range(spec.chunks - 2 * n + h + 1):  # 4: F0&B1 F1&B0
        if i == 0 and h == n - 1:  # the middle ranks do not overlap their first pair
            b.forward(s0)
            b.backward(s1)
        else:
            b.overlap(s0, s1)
        b.overlap(s1, s0)
    for _ in range(n - h - 1):  # 5: B1 F1&B0
        b.backward(s1)
        b.overlap(s1, s0)
    split = False
    for i in range(h + 1):  # 6: B1 B0, split from iteration (h+1)//2 on
        split = split or (i == (h + 1) // 2 and h % 2 == 1)
        b.backward(s1, split)
        split = split or (i == (h + 1) // 2 and h % 2 == 0)
        b.backward(s0, split)
    for _ in range(n - h - 1):  # 7: W I0
        b.weight()
        b.backward(s0, split=True)
    for _ in range(h + 1):  # 8: W
        b.weight()
    return b.finish()


def check_dualpipe(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks and num_microbatches are even and num_microbatches >= 2*num_ranks."""
    require_counts(DUALPIPE, num_ranks, num_microbatches, min_ranks=2)
    if num_ranks % 2:
        raise ValueError(f"{DUALPIPE} needs an even number of ranks, got num_ranks={num_ranks}")
    if num_microbatches % 2:
        raise ValueError(
            f"{DUALPIPE} needs an even number of microbatches, got num_microbatches={num_microbatches}"
        )
    if num_microbatches < 2 * num_ranks:
        raise ValueError(
            f"{DUALPIPE} needs num_microbatches >= 2 * num_ranks, "
            f"got num_microbatches={num_microbatches}, num_ranks={num_ranks}"
        )


def dualpipe_rank(rank: int, num_ranks: int, num_microbatches: int) -> DualRank:
    """Rank `rank`'s parameters in DualPipe: down copy = stage r, up copy = stage 2P-1-r."""
    half, c = num_ranks // 2, num_microbatches // 2
    down, up = (rank, range(c)), (2 * num_ranks - 1 - rank, range(c, 2 * c))
    (s0, m0), (s1, m1) = (down, up) if rank < half else (up, down)
    return DualRank(half, min(rank, num_ranks - 1 - rank), c, s0, s1, m0, m1)


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe: two model copies run in opposite directions; rank r holds parts r and P-1-r.

    Stages 0..P-1 are the downward copy (stage s on rank s), stage P+k is part k on rank
    P-1-k. Microbatches 0..M/2-1 enter at rank 0, M/2..M-1 at rank P-1.
    Needs P even, M even, M >= 2P. Bubble (P/2-1)(F&B+B-3W) per rank.
    """
    check_dualpipe(num_ranks, num_microbatches)
    rows = tuple(dual_row(dualpipe_rank(r, num_ranks, num_microbatches)) for r in range(num_ranks))
    return Schedule(DUALPIPE, num_ranks, num_microbatches, dual_stages(num_ranks), rows)


def check_dualpipev(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks >= 2 and num_microbatches >= 2*num_ranks."""
    require_counts(DUALPIPEV, num_ranks, num_microbatches, min_ranks=2)
    if num_microbatches < 2 * num_ranks:
        raise ValueError(
            f"{DUALPIPEV} needs num_microbatches >= 2 * num_ranks, "
            f"got num_microbatches={num_microbatches}, num_ranks={num_ranks}"
        )


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV: DualPipe's order folded onto one copy of 2P stages in a V (stage s on rank s or 2P-1-s).

    Rank r runs stage r (phase 0) and stage 2P-1-r (phase 1); every microbatch passes both.
    Needs M >= 2P. Bubble (P-1)(F&B+B-3W) per rank, with half of DualPipe's parameters.
    """
    check_dualpipev(num_ranks, num_microbatches)
    every = range(num_microbatches)
    rows = tuple(
        dual_row(DualRank(num_ranks, r, num_microbatches, r, 2 * num_ranks - 1 - r, every, every))
        for r in range(num_ranks)
    )
    return Schedule(DUALPIPEV, num_ranks, num_microbatches, v_stages(num_ranks), rows)
