"""The mail: message metas, their announcements, and the checks and handoffs of the Mailroom into a step's Mailbox."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from duplexpipe.comm.codec import CastCodec, IdentityCodec, TensorSpec, sends_as_is
from duplexpipe.comm.nonfinite import NonFiniteWatch, extremes
from duplexpipe.comm.p2p_codecs import Fp8RowCodec, Int8BlockCodec, p2p_codec_pair
from duplexpipe.errors import ActivationShapeError, NonFiniteSendError, PipelineError, PipelineTimeoutError
from duplexpipe.runtime.message_meta import Message, MessageMeta, encodes
from duplexpipe.runtime.messages import Mailbox, Mailroom
from duplexpipe.runtime.structure import flatten
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.layout import Layout
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

PAIR = flatten({"h": torch.zeros(1), "mask": torch.zeros(1)}, "out")[0]


def _message(rows: int = 2, mask_dtype: torch.dtype = torch.int64) -> Message:
    h = torch.zeros(rows, 4, requires_grad=True) * 1.0
    return Message(PAIR, [h, torch.zeros(rows, dtype=mask_dtype)], (True, False))


def test_meta_round_trips_through_json_and_lists_gradient_metas() -> None:
    meta = MessageMeta.of(_message())
    assert MessageMeta.from_json(meta.to_json(), "1RECV_F0") == meta
    assert meta.grad_metas == (TensorSpec((2, 4), torch.float32),)


def test_wire_format_is_announced_per_leaf_and_integers_are_never_encoded() -> None:
    meta = MessageMeta.of(_message(), CastCodec(torch.bfloat16))
    assert meta.wire == ((TensorSpec((2, 4), torch.bfloat16),), (TensorSpec((2,), torch.int64),))
    assert meta.payloads == (TensorSpec((2, 4), torch.bfloat16), TensorSpec((2,), torch.int64))
    back = MessageMeta.from_json(meta.to_json(), "1RECV_F0")
    assert back == meta and back.wire == meta.wire
    assert MessageMeta.of(_message()).payloads == meta.leaves  # no codec: each leaf as it is


def test_difference_names_the_leaf_path() -> None:
    want = MessageMeta.of(_message())
    assert want.difference(MessageMeta.of(_message()), "out") == ""
    assert 'the output out["mask"] has shape (2,) bool but (2,) int64 was expected' == want.difference(
        MessageMeta.of(_message(mask_dtype=torch.bool)), "out")
    assert "the output out has the form" in want.difference(MessageMeta.of(Message.single(torch.zeros(2))), "out")


def _box(shapes: dict[Any, MessageMeta] | None = None) -> Mailbox:
    """A training step's mailbox: learning the shapes (None), or with `shapes` known."""
    return Mailbox.of(1, True, shapes)


def _mailroom(store: Any, rank: int) -> Mailroom:
    layout = Layout.of(lower(build("interleaved-1f1b", 2, 4)))  # stage s on rank s % 2
    dog = Watchdog(store, "test", rank, timeout_s=0.3, poll_s=0.05)
    return Mailroom(layout, rank, None, store, "test", dog)  # type: ignore[arg-type]


def test_learning_step_announces_then_later_steps_check_every_leaf() -> None:
    store = dist.HashStore()
    sender, receiver = _mailroom(store, 0), _mailroom(store, 1)
    box = _box()
    sender.hand_on(box, 0, 0, _message())
    assert box.outbox[(Op.SEND_F, 0, 0)][0].requires_grad is False  # detached for the wire
    assert box.out_meta[(0, 0)] == MessageMeta.of(_message())
    assert box.leftovers() == ["produced but never sent: 0SEND_F0"]
    got = receiver.announced(1, 1, 0, block=True, peer=0)
    assert got == MessageMeta.of(_message())
    box = _box({(1, 0): got})
    assert not box.learning and not box.outbox and not box.out_meta  # a new step: an empty mailbox
    with pytest.raises(ActivationShapeError, match=r'stage 0 microbatch 0: the output out\["h"\] has shape '
                                                   r"\(3, 4\) float32 but \(2, 4\) float32 was expected"):
        sender.hand_on(box, 0, 0, _message(rows=3))
    with pytest.raises(PipelineTimeoutError, match="shape announcement of 1RECV_F1"):
        receiver.announced(1, 1, 1, block=True, peer=0)


class _Flattening:
    """Breaks its own wire format (sends a flattened tensor)."""

    name = "flattening"

    def wire_format(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        return (spec,)

    def encode(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.reshape(-1)]

    def decode(self, payloads: Any, spec: TensorSpec) -> torch.Tensor:
        return payloads[0].view(spec.shape)


def test_a_codec_that_breaks_its_wire_format_is_named_before_sending() -> None:
    store = dist.HashStore()
    layout = Layout.of(lower(build("1f1b", 2, 4)))
    dog = Watchdog(store, "test", 0, timeout_s=0.3, poll_s=0.05)
    mail = Mailroom(layout, 0, None, store, "test", dog, _Flattening())  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match=r"stage 0 microbatch 0: codec 'flattening' encoded \(2, 4\) "
                                            r"float32 into \['\(8,\) float32'\], not its wire format"):
        mail.hand_on(_box(), 0, 0, _message())


def test_same_rank_handoff_keeps_the_structure_and_gradient_flags() -> None:
    layout = Layout.of(lower(build("zbv", 2, 4)))  # stages 1 and 2 are both on rank 1
    mail, box = Mailroom(layout, 1, None, None, "test", None), _box()  # type: ignore[arg-type]
    mail.hand_on(box, 1, 0, _message())
    assert box.leftovers() == ["local activations never consumed: stage 2 microbatch 0"]
    handed = mail.take_input(box, 2, 0, None)  # type: ignore[arg-type]
    assert handed.form == PAIR and handed.grads == (True, False) and not handed.leaves[0].requires_grad
    grads = [torch.ones(2, 4)]
    mail.hand_back(box, 2, 0, grads)
    assert box.leftovers() == ["local gradients never consumed: stage 1 microbatch 0"]
    assert mail.take_grads(box, 1, 0, None) is grads  # type: ignore[arg-type]
    assert not box.outbox and not box.local_fwd and not box.local_grad and box.leftovers() == []


# ---------------------------------------------------------------- which leaves go through the activation codec
def test_only_floating_leaves_that_carry_a_gradient_may_be_encoded() -> None:
    codec, f32 = Int8BlockCodec(), TensorSpec((2, 4), torch.float32)
    assert encodes(codec, f32, grad=True)
    assert not encodes(codec, f32, grad=False)  # a float mask, positions: forward only
    assert not encodes(codec, TensorSpec((2,), torch.int64), grad=True)
    assert not encodes(None, f32, grad=True)


def _masked(h: torch.Tensor, dtype: torch.dtype = torch.float32) -> Message:
    """{"h": h (carries a gradient), "mask": an additive mask holding finfo.min (forward only)}."""
    mask = torch.zeros(2, 4, dtype=dtype)
    mask[:, 2:] = torch.finfo(dtype).min
    return Message(PAIR, [h, mask], (True, False))


def _sent(codec: Any, message: Message, watch: NonFiniteWatch, steps: int = 1) -> tuple[MessageMeta, list[Any]]:
    """The meta rank 0 announces for `message` and what rank 1 decodes from its payloads (1F1B on 2 ranks)."""
    store = dist.HashStore()
    dog = Watchdog(store, "test", 0, timeout_s=0.3, poll_s=0.05)
    mail = Mailroom(Layout.of(lower(build("1f1b", 2, 4))), 0, None, store, "test", dog,  # type: ignore[arg-type]
                    codec, codec, watch)
    box = _box()
    for step in range(steps):
        if step:
            box = _box(box.shapes)
        mail.hand_on(box, 0, 0, message)
    meta = box.shapes[(1, 0)]
    payloads = box.outbox[(Op.SEND_F, 0, 0)]
    return meta, mail._decode(codec, payloads, meta.leaves, meta.wire, meta.coded)


@pytest.mark.parametrize("codec", [Int8BlockCodec(), Fp8RowCodec("e4m3")], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_forward_only_mask_travels_exactly_beside_encoded_activations(codec: Any, dtype: torch.dtype) -> None:
    h = torch.randn(2, 4, dtype=dtype, generator=torch.Generator().manual_seed(1))
    watch = NonFiniteWatch()
    meta, (got_h, got_mask) = _sent(codec, _masked(h, dtype), watch)
    assert meta.coded == (True, False) and meta.wire[1] == (TensorSpec((2, 4), dtype),)
    assert MessageMeta.from_json(meta.to_json(), "1RECV_F0").coded == (True, False)  # announced
    assert torch.equal(got_mask, _masked(h, dtype).leaves[1])  # bit for bit, finfo.min included
    assert not torch.equal(got_h, h) and torch.allclose(got_h, h, rtol=0.2, atol=0.1)  # the codec did run
    assert watch.exact_sends == 0 and watch.events == 0


@pytest.mark.parametrize("value", [float("-inf"), float("nan"), torch.finfo(torch.float32).min, 2e38])
def test_an_activation_holding_inf_or_a_float_extreme_is_sent_exactly_and_counted(value: float) -> None:
    h = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
    h[1, 3] = value
    watch = NonFiniteWatch()
    with pytest.warns(RuntimeWarning, match=r'rank 0: stage 0 microbatch 0: out\["h"\] holds 1 values that are '
                                            r"NaN, inf or float extremes .* codec 'int8-block256' cannot carry"):
        meta, (got_h, _) = _sent(Int8BlockCodec(), _masked(h), watch, steps=3)
    assert meta.coded == (False, False) and meta.held_back == 1
    assert torch.equal(got_h, h) or (value != value and torch.equal(got_h.isnan(), h.isnan()))
    assert watch.exact_sends == 3  # every send of it is counted
    assert watch.events == (0 if abs(value) < float("inf") else 1)  # NaN/inf: also a non-finite event


def test_under_the_raise_policy_a_non_finite_activation_stops_even_when_sent_exactly() -> None:
    h = torch.randn(2, 4)
    h[0, 0] = float("inf")
    with pytest.raises(NonFiniteSendError, match=r"rank 0: stage 0 microbatch 0: a tensor sent with codec "
                                                 r"'int8-block256' held NaN or inf \(1 elements\); "
                                                 r'out\["h"\] is sent exactly'):
        _sent(Int8BlockCodec(), _masked(h), NonFiniteWatch("raise"))


def test_a_large_but_ordinary_activation_is_still_encoded() -> None:
    h = torch.randn(2, 4, generator=torch.Generator().manual_seed(3)) * 1e30  # far from float32's extremes
    meta, (got_h, _) = _sent(Int8BlockCodec(), _masked(h), NonFiniteWatch())
    assert meta.coded == (True, False) and (got_h - h).abs().max() <= h.abs().max() / 254 * 1.01
    assert extremes(h).item() == 0 and extremes(_masked(h).leaves[1]).item() == 4


@pytest.mark.parametrize("codec", [Int8BlockCodec(), Fp8RowCodec("e4m3"), Fp8RowCodec("e5m2")],
                         ids=["int8", "fp8-e4m3", "fp8-e5m2"])
def test_a_float_extreme_after_the_shapes_were_learned_still_decodes_finite(codec: Any) -> None:
    """The decision is announced with the shapes; a later send of an encoded leaf holding finfo.min goes
    through the codec, and a finite tensor always decodes finite (never inf, never NaN downstream)."""
    h = torch.randn(2, 4, generator=torch.Generator().manual_seed(4))
    store = dist.HashStore()
    dog = Watchdog(store, "test", 0, timeout_s=0.3, poll_s=0.05)
    mail = Mailroom(Layout.of(lower(build("1f1b", 2, 4))), 0, None, store, "test", dog,  # type: ignore[arg-type]
                    codec, codec, NonFiniteWatch())
    box = _box()
    mail.hand_on(box, 0, 0, _masked(h))
    box = _box(box.shapes)
    h[0, 1] = torch.finfo(torch.float32).min
    mail.hand_on(box, 0, 0, _masked(h))
    meta = box.shapes[(1, 0)]
    got_h, _ = mail._decode(codec, box.outbox[(Op.SEND_F, 0, 0)], meta.leaves, meta.wire, meta.coded)
    assert meta.coded == (True, False) and bool(got_h.isfinite().all())
    assert got_h[0, 1] <= 0.99 * torch.finfo(torch.float32).min


def test_a_codec_that_sends_as_is_is_skipped_and_an_adaptive_one_is_kept() -> None:
    """The Mailroom asks a codec whether it sends as is (not its class): the adaptive codec is an IdentityCodec
    whose links still choose their rungs."""
    act, grad = p2p_codec_pair("adaptive(ladder=none/bf16)", "PrecisionConfig.p2p_compression")
    assert isinstance(act, IdentityCodec) and not sends_as_is(act) and sends_as_is(IdentityCodec())
    assert sends_as_is(None) and not sends_as_is(CastCodec()) and not sends_as_is(_Flattening())  # type: ignore[arg-type]
    layout = Layout.of(lower(build("1f1b", 2, 2)))
    dog = Watchdog(dist.HashStore(), "test", 0, timeout_s=0.3, poll_s=0.05)
    plain = Mailroom(layout, 0, None, None, "test", dog, IdentityCodec(), IdentityCodec())  # type: ignore[arg-type]
    adaptive = Mailroom(layout, 0, None, None, "test", dog, act, grad)  # type: ignore[arg-type]
    assert plain.activation_codec is None and plain.gradient_codec is None
    assert adaptive.activation_codec is act and adaptive.gradient_codec is grad
