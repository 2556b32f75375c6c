"""1F1B (PipeDream-flush): warm up with P-1-r forwards, then alternate one forward and one backward."""

from __future__ import annotations

from duplexpipe.schedules.generators._common import linear_stages, require_counts
from duplexpipe.schedules.ir import Action, Op, Schedule

NAME = "1f1b"


def check_one_f_one_b(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks >= 1 and num_microbatches >= 1 (both integers)."""
    require_counts(NAME, num_ranks, num_microbatches)


def one_f_one_b_row(rank: int, num_ranks: int, num_microbatches: int) -> tuple[Action, ...]:
    """Rank `rank`'s list: min(P-1-r, M) warm-up forwards, steady F/B pairs, cool-down backwards."""
    warmup = min(num_ranks - 1 - rank, num_microbatches)
    row = [Action(rank, Op.F, m) for m in range(warmup)]
    for k in range(num_microbatches - warmup):
        row += [Action(rank, Op.F, warmup + k), Action(rank, Op.B, k)]
    row += [Action(rank, Op.B, m) for m in range(num_microbatches - warmup, num_microbatches)]
    return tuple(row)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B with stage s on rank s; at most P-r activations live on rank r.

    The bubble is (P-1)(F+B) per rank when M >= P.
    """
    check_one_f_one_b(num_ranks, num_microbatches)
    rows = tuple(one_f_one_b_row(r, num_ranks, num_microbatches) for r in range(num_ranks))
    return Schedule(NAME, num_ranks, num_microbatches, linear_stages(num_ranks), rows)
