"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism"): ZB-H1, ZB-H2 and ZB-V."""

from __future__ import annotations

from duplexpipe.schedules.generators._common import RowBuilder, linear_stages, require_counts, v_stages
from duplexpipe.schedules.ir import Action, Schedule

ZB_H1 = "zb-h1"
ZB_H2 = "zb-h2"
ZBV = "zbv"


def check_zb_h1(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks >= 1 and num_microbatches >= 1 (both integers)."""
    require_counts(ZB_H1, num_ranks, num_microbatches)


def zb_h1_row(rank: int, num_ranks: int, num_microbatches: int) -> tuple[Action, ...]:
    """1F1B's order with every backward split: rank r runs W(j-r) right after its j-th I."""
    b = RowBuilder({rank: range(num_microbatches)})
    warmup = min(num_ranks - 1 - rank, num_microbatches)
    for _ in range(warmup):
        b.forward(rank)
    for j in range(num_microbatches):
        if warmup + j < num_microbatches:
            b.forward(rank)
        b.backward(rank, split=True)
        if j >= rank:
            b.weight()
    b.flush_weights()
    return b.finish()


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with B split into I and W; rank r defers its W by r to fill the cool-down bubble.

    Every rank holds at most P activations (1F1B's peak); the bubble is (P-1)(F+B-2W)
    per rank with F = I = W (B = I + W).
    """
    check_zb_h1(num_ranks, num_microbatches)
    rows = tuple(zb_h1_row(r, num_ranks, num_microbatches) for r in range(num_ranks))
    return Schedule(ZB_H1, num_ranks, num_microbatches, linear_stages(num_ranks), rows)


def check_zb_h2(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks >= 1 and num_microbatches >= 1 (both integers)."""
    require_counts(ZB_H2, num_ranks, num_microbatches)


def zb_h2_row(rank: int, num_ranks: int, num_microbatches: int) -> tuple[Action, ...]:
    """2(P-1-r)+1 warm-up forwards, then I, its W deferred by 2r microbatches, F; leftover Ws last."""
    b = RowBuilder({rank: range(num_microbatches)})
    warmup = min(2 * (num_ranks - 1 - rank) + 1, num_microbatches)
    for _ in range(warmup):
        b.forward(rank)
    for j in range(num_microbatches):
        b.backward(rank, split=True)
        if j >= 2 * rank:
            b.weight()
        if warmup + j < num_microbatches:
            b.forward(rank)
    b.flush_weights()
    return b.finish()


def zb_h2(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H2: ZB-H1's order with twice the warm-up and each W deferred by 2r instead of r on rank r.

    The extra forwards fill the bubble before the first backward and the deferred Ws the
    tail, so the ranks' busy spans form a parallelogram: with F = I = W the makespan is
    (P-1)F + M(F+B), and the longer warm-up hides message latency that ZB-H1 cannot. Every
    rank holds at most 2P-1 activations (1F1B: P).
    """
    check_zb_h2(num_ranks, num_microbatches)
    rows = tuple(zb_h2_row(r, num_ranks, num_microbatches) for r in range(num_ranks))
    return Schedule(ZB_H2, num_ranks, num_microbatches, linear_stages(num_ranks), rows)


def check_zbv(num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks >= 2 and num_microbatches >= 1 (both integers)."""
    require_counts(ZBV, num_ranks, num_microbatches, min_ranks=2)


def _zbv_full_row(rank: int, num_ranks: int, n: int) -> list[Action]:
    """ZB-V's hand-made order for n >= 2P-1 microbatches (stage r = chunk 0, 2P-1-r = chunk 1)."""
    s0, s1 = rank, 2 * num_ranks - 1 - rank
    b = RowBuilder({s0: range(n), s1: range(n)})
    for _ in range(2 * (num_ranks - rank) - 1):
        b.forward(s0)
    for _ in range(rank):
        b.forward(s1)
        b.forward(s0)
    for _ in range(num_ranks - rank):
        b.forward(s1)
        b.backward(s1, split=True)
        b.weight(s1)
    while b.forwards_done(s1) < b.forwards_done(s0) or b.forwards_done(s0) < n:
        if b.forwards_done(s0) < n:
            b.forward(s0)
        b.backward(s0, split=True)
        b.weight(s0)
        b.forward(s1)
        b.backward(s1, split=True)
        b.weight(s1)
    for _ in range(rank):
        b.backward(s0, split=True)
        b.backward(s1, split=True)
    for _ in range(num_ranks - rank):
        b.backward(s0, split=True)
        b.weight(s0)
    b.flush_weights(s1)
    b.flush_weights(s0)
    return list(b.finish())


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V: 2P stages in a V (stage s on rank s for s < P, else 2P-1-s), B split into I and W.

    Any M >= 1 works: the order is built for max(M, 2P-1) microbatches and the ones
    beyond M are dropped, which keeps every remaining dependency in order.
    """
    check_zbv(num_ranks, num_microbatches)
    n = max(num_microbatches, 2 * num_ranks - 1)
    rows = tuple(
        tuple(a for a in _zbv_full_row(r, num_ranks, n) if a.microbatch < num_microbatches)
        for r in range(num_ranks)
    )
    return Schedule(ZBV, num_ranks, num_microbatches, v_stages(num_ranks), rows)
