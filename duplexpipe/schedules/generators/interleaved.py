"""Interleaved 1F1B (Megatron-LM): each rank runs `chunks` stages; microbatches advance in rounds of P."""

from __future__ import annotations

from duplexpipe.schedules.generators._common import looped_stages, require_counts, require_int
from duplexpipe.schedules.ir import Action, Op, Schedule

NAME = "interleaved-1f1b"


def check_interleaved_1f1b(num_ranks: int, num_microbatches: int, chunks: int = 2) -> None:
    """Raise ValueError unless num_ranks >= 2, chunks >= 2 and num_microbatches is a multiple of num_ranks."""
    require_counts(NAME, num_ranks, num_microbatches, min_ranks=2)
    require_int(NAME, "chunks", chunks, 2)
    if num_microbatches % num_ranks:
        raise ValueError(
            f"{NAME} needs num_microbatches to be a multiple of num_ranks, "
            f"got num_microbatches={num_microbatches}, num_ranks={num_ranks}"
        )


def _unit(k: int, num_ranks: int, chunks: int, backward: bool) -> tuple[int, int]:
    """The (chunk, microbatch) of a rank's k-th forward (or backward) in Megatron's order."""
    chunk = (k // num_ranks) % chunks
    if backward:
        chunk = chunks - 1 - chunk
    microbatch = (k // (num_ranks * chunks)) * num_ranks + k % num_ranks
    return chunk, microbatch


def interleaved_row(rank: int, num_ranks: int, num_microbatches: int, chunks: int) -> tuple[Action, ...]:
    """Rank `rank`'s list: 2(P-1-r) + (v-1)P warm-up forwards, steady F/B pairs, cool-down backwards."""
    total = num_microbatches * chunks
    warmup = min(2 * (num_ranks - 1 - rank) + (chunks - 1) * num_ranks, total)

    def act(k: int, op: Op) -> Action:
        chunk, microbatch = _unit(k, num_ranks, chunks, backward=op is Op.B)
        return Action(chunk * num_ranks + rank, op, microbatch)

    row = [act(k, Op.F) for k in range(warmup)]
    for k in range(total - warmup):
        row += [act(warmup + k, Op.F), act(k, Op.B)]
    row += [act(k, Op.B) for k in range(total - warmup, total)]
    return tuple(row)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: P*chunks stages, stage s on rank s mod P.

    Constraint: num_microbatches % num_ranks == 0 (microbatches move in rounds of P).
    The bubble shrinks to about (P-1)(F+B)/chunks per rank, with F and B per chunk.
    """
    check_interleaved_1f1b(num_ranks, num_microbatches, chunks)
    rows = tuple(interleaved_row(r, num_ranks, num_microbatches, chunks) for r in range(num_ranks))
    return Schedule(NAME, num_ranks, num_microbatches, looped_stages(num_ranks, chunks), rows)
