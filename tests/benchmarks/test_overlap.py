"""benchmarks.overlap: the waited baseline moves each receive right before its consumer, in peer order."""

from __future__ import annotations

import pytest

from benchmarks.overlap import CONSUMER, _peer, receives_at_consumers
from duplexpipe import Op, build_schedule, lower, verify


@pytest.mark.parametrize(("name", "ranks", "mbs"), [("1f1b", 4, 8), ("zbv", 2, 4), ("dualpipe", 4, 8),
                                                    ("interleaved-1f1b", 2, 4), ("dualpipev", 2, 4)])
def test_receives_move_down_to_their_consumers_in_each_peers_order(name: str, ranks: int, mbs: int) -> None:
    schedule = build_schedule(name, ranks, mbs)
    before, after = lower(schedule), receives_at_consumers(schedule)
    verify(after)
    for old, new in zip(before.actions, after.actions, strict=True):
        assert sorted(map(str, old)) == sorted(map(str, new))  # the same actions
        assert [a for a in old if not a.op.is_comm] == [a for a in new if not a.op.is_comm]
        recvs = [a for a in new if a.op in CONSUMER]
        for peer in {_peer(after, r) for r in recvs}:  # each peer's messages are posted in the lowered order
            assert [r for r in recvs if _peer(after, r) == peer] == [r for r in old if r in recvs and
                                                                      _peer(after, r) == peer]
        for k, recv in enumerate(new):
            if recv.op not in CONSUMER:
                continue
            nxt = new[k + 1]  # the next action consumes it, or is another receive (one of a run before a consumer)
            assert nxt.op in CONSUMER or any(p.stage == recv.stage and p.microbatch == recv.microbatch
                                             and p.op in CONSUMER[recv.op] for p in nxt.compute_parts())
            computed = [sum(1 for a in row[:row.index(recv)] if not a.op.is_comm) for row in (old, new)]
            assert computed[1] >= computed[0]  # moved down past compute, never up


def test_the_lowered_schedule_already_posts_receives_earlier() -> None:
    lowered, moved = lower(build_schedule("1f1b", 2, 4)), receives_at_consumers(build_schedule("1f1b", 2, 4))
    at = {str(a): k for k, a in enumerate(lowered.actions[1])}
    later = {str(a): k for k, a in enumerate(moved.actions[1])}
    gaps = [later[str(a)] - at[str(a)] for a in lowered.actions[1] if a.op is Op.RECV_F]
    assert all(g >= 0 for g in gaps) and any(g > 0 for g in gaps)
