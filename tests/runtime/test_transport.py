"""The mail's transport on 2 gloo ranks: in-order posting with late shapes, known shapes, freeing, misuse."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from duplexpipe.comm.codec import TensorSpec
from duplexpipe.errors import PipelineError
from duplexpipe.runtime.handshake import group_store
from duplexpipe.runtime.message_meta import Message, MessageMeta
from duplexpipe.runtime.messages import Mailroom
from duplexpipe.runtime.transport import MailTransport, key_text
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.layout import Layout
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

CPU = torch.device("cpu")


def test_key_text_is_the_action_text() -> None:
    assert key_text((Op.RECV_F, 3, 7)) == "3RECV_F7"
    assert key_text((Op.SEND_B, 0, 2)) == "0SEND_B2"


def _setup(rank: int, prefix: str) -> tuple[Any, MailTransport, Mailroom]:
    group = dist.new_group([0, 1])
    dist.barrier(group=group)  # a first collective on the new group, as the runtime's handshake
    dog = Watchdog(group_store(group), prefix, rank, timeout_s=20.0, poll_s=0.05, gloo=True)
    transport = MailTransport(group, CPU, dog)
    return group, transport, Mailroom(Layout.of(lower(build("1f1b", 2, 2))), rank, transport, group_store(group),
                                      prefix, dog)


def _payload(mb: int) -> torch.Tensor:
    return torch.arange((2 + mb) * 3, dtype=torch.float32).reshape(2 + mb, 3) + 100 * mb


def _late_shapes(rank: int) -> dict[str, Any]:
    """Receives are queued before their shapes exist and consumed out of order."""
    _, transport, board = _setup(rank, "late")
    if rank == 0:
        time.sleep(0.3)  # rank 1 queues both receives before anything is announced
        for mb in (0, 1):
            board.announce(step=1, stage=1, microbatch=mb, meta=MessageMeta.of(Message.single(_payload(mb))))
            transport.send((Op.SEND_F, 0, mb), [_payload(mb)], peer=1)
        transport.finish()
        return {}

    def resolve(mb: int) -> Any:
        def lookup(block: bool) -> tuple[TensorSpec, ...] | None:
            meta = board.announced(1, 1, mb, block, 0)
            return None if meta is None else meta.leaves
        return lookup

    for mb in (0, 1):
        transport.expect((Op.RECV_F, 1, mb), 0, resolve(mb))
    [second] = transport.take((Op.RECV_F, 1, 1), "1F1")  # forces 1RECV_F0 to be posted first
    [first] = transport.take((Op.RECV_F, 1, 0), "1F0")
    transport.finish()
    return {"late_ok": torch.equal(first, _payload(0)) and torch.equal(second, _payload(1))}


def _known_shapes(rank: int) -> dict[str, Any]:
    """Known shapes post at once; integer and bfloat16 tensors travel too, one or several per message;
    sends are freed."""
    _, transport, _ = _setup(rank, "known")
    tensors = [torch.arange(6).reshape(2, 3), torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
               .to(torch.bfloat16)]
    if rank == 0:
        for mb, t in enumerate(tensors):
            transport.send((Op.SEND_B, 1, mb), [t], peer=1)
        transport.send((Op.SEND_B, 1, 2), tensors, peer=1)
        held = transport.pending_sends
        time.sleep(0.5)
        transport.reap()  # gloo: a no-op (a send is seen complete only once waited for)
        reaped = transport.pending_sends
        transport.finish()
        return {"held": held, "after_reap": reaped, "after_finish": transport.pending_sends}
    for mb, t in enumerate(tensors):
        transport.expect((Op.RECV_B, 0, mb), 0, lambda block, t=t: (TensorSpec.of(t),))
    transport.expect((Op.RECV_B, 0, 2), 0, lambda block: tuple(TensorSpec.of(t) for t in tensors))
    got = [transport.take((Op.RECV_B, 0, mb), f"0B{mb}")[0] for mb in range(2)]
    both = transport.take((Op.RECV_B, 0, 2), "0B2")
    transport.finish()
    same = [torch.equal(g, t) and g.dtype == t.dtype for g, t in zip(got + both, tensors + tensors, strict=True)]
    return {"known_ok": all(same) and len(both) == 2}


def _known_in_order(rank: int) -> dict[str, Any]:
    """Receives whose shapes are known are posted when listed, in order, and consumed in any order."""
    _, transport, _ = _setup(rank, "listed")
    if rank == 0:
        for mb in range(3):
            transport.send((Op.SEND_F, 0, mb), [_payload(mb)], peer=1)
        transport.finish()
        return {}
    asked: list[int] = []

    def resolver(mb: int) -> Any:
        def resolve(block: bool) -> tuple[TensorSpec, ...]:
            asked.append(mb)
            return (TensorSpec.of(_payload(mb)),)
        return resolve

    posted = []
    for mb in range(3):
        transport.expect((Op.RECV_F, 1, mb), 0, resolver(mb))
        posted.append(list(asked))
    [second] = transport.take((Op.RECV_F, 1, 1), "1F1")
    after_second = list(asked)
    [first], [third] = transport.take((Op.RECV_F, 1, 0), "1F0"), transport.take((Op.RECV_F, 1, 2), "1F2")
    transport.finish()
    intact = all(torch.equal(t, _payload(mb)) for mb, t in enumerate((first, second, third)))
    return {"asked": (posted, after_second, asked), "listed_ok": intact}


def _misuse(rank: int) -> dict[str, Any]:
    _, transport, _ = _setup(rank, "misuse")
    meta = (TensorSpec((2,), torch.float32),)
    if rank == 0:
        transport.send((Op.SEND_F, 0, 0), [torch.ones(2)], peer=1)
        transport.wait_send((Op.SEND_F, 0, 0))
        try:
            transport.wait_send((Op.SEND_F, 0, 0))
            return {"waited_twice": "no error"}
        except PipelineError as exc:
            return {"waited_twice": str(exc)}
    errors = []
    for attempt in (lambda: transport.expect((Op.RECV_F, 1, 9), 1, lambda block: meta),
                    lambda: transport.take((Op.RECV_F, 1, 5), "1F5"),
                    lambda: transport.expect((Op.RECV_F, 1, 0), 0, lambda block: meta),
                    lambda: transport.finish()):
        if len(errors) == 2:
            transport.expect((Op.RECV_F, 1, 0), 0, lambda block: meta)
        try:
            attempt()
            errors.append("no error")
        except PipelineError as exc:
            errors.append(str(exc))
    return {"misuse": errors}


def _stamped(rank: int) -> dict[str, Any]:
    """Stamped sends on scripted clocks: rank 1 begins each wait at wall time 100.0 (its wait clock 5.0) and the
    message is there at 5.05. Posted at 100.03 (the sender still computing for 30 ms), 20 ms are exposed; posted
    at 99.9 (before the wait), all 50 ms; posted at 100.08 (clocks that disagree), none."""
    _, transport, _ = _setup(rank, "stamped")
    transport.stamp_sends = True
    posted = [100.03, 99.9, 100.08]
    if rank == 0:
        stamps = iter(posted)
        transport.wall = lambda: next(stamps)
        for mb in range(3):
            transport.send((Op.SEND_F, 0, mb), [_payload(mb)], peer=1)
        transport.finish()
        return {}
    ticks = iter([5.0, 5.05] * 3)
    transport.clock, transport.wall = lambda: next(ticks), lambda: 100.0
    got = []
    for mb in range(3):
        transport.expect((Op.RECV_F, 1, mb), 0, lambda block, mb=mb: (TensorSpec.of(_payload(mb)),))
        got += transport.take((Op.RECV_F, 1, mb), f"1F{mb}")
    transport.finish()
    return {"stamped_waits": transport.recv_waits,
            "stamped_ok": all(torch.equal(t, _payload(mb)) for mb, t in enumerate(got))}


def _worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario in (_late_shapes, _known_shapes, _known_in_order, _misuse, _stamped):
        dist.barrier()
        out.update(scenario(rank))
    return out


def test_receives_post_in_schedule_order_once_shapes_are_announced(results: Any) -> None:
    assert results[1]["late_ok"]


def test_known_shapes_and_dtypes_arrive_intact(results: Any) -> None:
    assert results[1]["known_ok"]


def test_sent_tensors_are_released_by_the_end_of_the_step(results: Any) -> None:
    assert results[0]["held"] == results[0]["after_reap"] == 3  # gloo: released at the end of the step
    assert results[0]["after_finish"] == 0


def test_misuse_is_reported_with_the_action(results: Any) -> None:
    to_self, not_posted, twice, unconsumed = results[1]["misuse"]
    assert "rank 1: 1RECV_F9 names rank 1 itself as its peer" in to_self
    assert "rank 1: 1F5 needs 1RECV_F5, which the schedule did not post before it" in not_posted
    assert "rank 1: 1RECV_F0 is posted twice" in twice
    assert "rank 1: receives posted but never consumed: ['1RECV_F0']" in unconsumed
    assert "rank 0: no pending send 0SEND_F0" in results[0]["waited_twice"]


def test_receives_with_known_shapes_are_posted_when_listed_in_order(results: Any) -> None:
    assert results[1]["asked"] == ([[0], [0, 1], [0, 1, 2]], [0, 1, 2], [0, 1, 2])  # never asked again
    assert results[1]["listed_ok"]


def test_a_receive_is_exposed_only_beyond_the_senders_compute(results: Any) -> None:
    waits = results[1]["stamped_waits"]
    assert results[1]["stamped_ok"] and len(waits) == 2
    assert [w[0] for w in waits] == [0, 0]
    assert [w[1] for w in waits] == [pytest.approx(5.03), 5.0] and [w[2] for w in waits] == [5.05, 5.05]
