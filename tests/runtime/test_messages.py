"""Message plumbing: message metas, their announcements, and the checks and handoffs of the Mailroom."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from duplexpipe.comm.codec import CastCodec
from duplexpipe.runtime.context import StepContext
from duplexpipe.runtime.messages import Mailroom, MessageMeta, MetaBoard
from duplexpipe.runtime.stage_compute import Message, TensorMeta
from duplexpipe.runtime.structure import Form
from duplexpipe.runtime.watchdog import ActivationShapeError, PipelineError, PipelineTimeoutError, Watchdog
from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.layout import Layout
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

PAIR = Form("dict", ("h", "mask"))


def _message(rows: int = 2, mask_dtype: torch.dtype = torch.int64) -> Message:
    h = torch.zeros(rows, 4, requires_grad=True) * 1.0
    return Message(PAIR, [h, torch.zeros(rows, dtype=mask_dtype)], (True, False))


def test_meta_round_trips_through_json_and_lists_gradient_metas() -> None:
    meta = MessageMeta.of(_message())
    assert MessageMeta.from_json(meta.to_json(), "1RECV_F0") == meta
    assert meta.grad_metas == (TensorMeta((2, 4), torch.float32),)


def test_wire_format_is_announced_per_leaf_and_integers_are_never_encoded() -> None:
    meta = MessageMeta.of(_message(), CastCodec(torch.bfloat16))
    assert meta.wire == ((TensorMeta((2, 4), torch.bfloat16),), (TensorMeta((2,), torch.int64),))
    assert meta.payloads == (TensorMeta((2, 4), torch.bfloat16), TensorMeta((2,), torch.int64))
    back = MessageMeta.from_json(meta.to_json(), "1RECV_F0")
    assert back == meta and back.wire == meta.wire
    assert MessageMeta.of(_message()).payloads == meta.leaves  # no codec: each leaf as it is


def test_difference_names_the_leaf_path() -> None:
    want = MessageMeta.of(_message())
    assert want.difference(MessageMeta.of(_message()), "out") == ""
    assert 'the output out["mask"] has shape (2,) bool but (2,) int64 was expected' == want.difference(
        MessageMeta.of(_message(mask_dtype=torch.bool)), "out")
    assert "the output out has the form" in want.difference(MessageMeta.of(Message.single(torch.zeros(2))), "out")


def _ctx(learning: bool, shapes: dict[Any, MessageMeta] | None = None) -> StepContext:
    return StepContext(train=True, step=1, learning=learning, shapes=shapes or {}, weights=[1.0])


def _mailroom(store: Any, rank: int) -> Mailroom:
    layout = Layout.of(lower(build("interleaved-1f1b", 2, 4)))  # stage s on rank s % 2
    dog = Watchdog(store, "test", rank, timeout_s=0.3, poll_s=0.05)
    return Mailroom(layout, rank, None, MetaBoard(store, "test", dog))  # type: ignore[arg-type]


def test_learning_step_announces_then_later_steps_check_every_leaf() -> None:
    store = dist.HashStore()
    sender, receiver = _mailroom(store, 0), _mailroom(store, 1)
    ctx = _ctx(learning=True)
    sender.hand_on(ctx, 0, 0, _message())
    assert ctx.outbox[(Op.SEND_F, 0, 0)][0].requires_grad is False  # detached for the wire
    assert ctx.out_meta[(0, 0)] == MessageMeta.of(_message())
    got = receiver.board.lookup(1, 1, 0, block=True, peer=0)
    assert got == MessageMeta.of(_message())
    later = _ctx(learning=False, shapes={(1, 0): got})
    with pytest.raises(ActivationShapeError, match=r'stage 0 microbatch 0: the output out\["h"\] has shape '
                                                   r"\(3, 4\) float32 but \(2, 4\) float32 was expected"):
        sender.hand_on(later, 0, 0, _message(rows=3))
    with pytest.raises(PipelineTimeoutError, match="shape announcement of 1RECV_F1"):
        receiver.board.lookup(1, 1, 1, block=True, peer=0)


class _Flattening:
    """Breaks its own wire format (sends a flattened tensor)."""

    name = "flattening"

    def wire_format(self, spec: TensorMeta) -> tuple[TensorMeta, ...]:
        return (spec,)

    def encode(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.reshape(-1)]

    def decode(self, payloads: Any, spec: TensorMeta) -> torch.Tensor:
        return payloads[0].view(spec.shape)


def test_a_codec_that_breaks_its_wire_format_is_named_before_sending() -> None:
    store = dist.HashStore()
    layout = Layout.of(lower(build("1f1b", 2, 4)))
    dog = Watchdog(store, "test", 0, timeout_s=0.3, poll_s=0.05)
    mail = Mailroom(layout, 0, None, MetaBoard(store, "test", dog), _Flattening())  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match=r"stage 0 microbatch 0: codec 'flattening' encoded \(2, 4\) "
                                            r"float32 into \['\(8,\) float32'\], not its wire format"):
        mail.hand_on(_ctx(learning=True), 0, 0, _message())


def test_same_rank_handoff_keeps_the_structure_and_gradient_flags() -> None:
    layout = Layout.of(lower(build("zbv", 2, 4)))  # stages 1 and 2 are both on rank 1
    mail = Mailroom(layout, 1, None, None)  # type: ignore[arg-type]
    ctx = _ctx(learning=True)
    mail.hand_on(ctx, 1, 0, _message())
    handed = mail.take_input(ctx, 2, 0, None)  # type: ignore[arg-type]
    assert handed.form == PAIR and handed.grads == (True, False) and not handed.leaves[0].requires_grad
    grads = [torch.ones(2, 4)]
    mail.hand_back(ctx, 2, 0, grads)
    assert mail.take_grads(ctx, 1, 0, None) is grads  # type: ignore[arg-type]
    assert not ctx.outbox and not ctx.local_fwd and not ctx.local_grad
