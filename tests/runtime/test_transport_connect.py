"""MailTransport.connect on 4 gloo ranks: every rank opens its pairs in one sorted order without deadlock,
and messages then flow over each pair (gloo's send, like a first NCCL message, waits for the peer)."""

from __future__ import annotations

from typing import Any

import torch

from duplexpipe.comm.codec import TensorSpec
from duplexpipe.runtime.handshake import group_store
from duplexpipe.runtime.transport import MailTransport
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.layout import Layout
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

WORLD = 4
META = TensorSpec.of(torch.empty(2))


def _worker(rank: int, world: int) -> dict[str, Any]:
    pairs = sorted(set(Layout.of(lower(build("interleaved-1f1b", world, 8))).rank_pairs())
                   | {(0, r) for r in range(1, world)})
    dog = Watchdog(group_store(None), "connect", rank, timeout_s=30.0, poll_s=0.05, gloo=True)
    transport = MailTransport(None, torch.device("cpu"), dog)
    transport.connect(pairs)
    got: dict[int, float] = {}
    for low, high in pairs:  # one message from the lower rank to the higher over every pair
        if rank == low:
            transport.send((Op.SEND_F, low, high), [torch.full((2,), float(low))], high)
        elif rank == high:
            transport.expect((Op.RECV_F, high, low), low, lambda _block: (META,))
            got[low] = float(transport.take((Op.RECV_F, high, low), "the test")[0][0])
    transport.finish()
    return {"pairs": pairs, "got": got}


def test_every_rank_opens_its_pairs_and_messages_flow(results: list[dict[str, Any]]) -> None:
    pairs = results[0]["pairs"]
    assert pairs == [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)]
    for rank, rec in enumerate(results):
        assert rec["got"] == {low: float(low) for low, high in pairs if high == rank}
