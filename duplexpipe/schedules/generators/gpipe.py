"""GPipe: every forward, then every backward (microbatches in order on each rank)."""

from __future__ import annotations

from duplexpipe.schedules.generators._common import linear_stages, require_counts
from duplexpipe.schedules.ir import Action, Op, Schedule

NAME = "gpipe"


def check_gpipe(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks >= 1 and num_microbatches >= 1 (both integers)."""
    require_counts(NAME, num_ranks, num_microbatches)


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe with stage s on rank s: F0..F(M-1), then B0..B(M-1) on every rank.

    Peak activations are M on every rank; the bubble is (P-1)(F+B) per rank.
    """
    check_gpipe(num_ranks, num_microbatches)
    rows = tuple(
        tuple(Action(r, Op.F, m) for m in range(num_microbatches))
        + tuple(Action(r, Op.B, m) for m in range(num_microbatches))
        for r in range(num_ranks)
    )
    return Schedule(NAME, num_ranks, num_microbatches, linear_stages(num_ranks), rows)
