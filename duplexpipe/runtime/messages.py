"""Message plumbing: tensor structures between stages, their announcements, local handoffs and transport.

A forward message is the structure one stage hands the next (a tensor, a tuple/list or a
flat dict); a backward message is the list of gradients of the leaves that carry one back
(floating tensors that required grad), in leaf order. Between ranks every leaf travels as its
payload tensors, keyed by the SEND/RECV action: a floating leaf as its codec's payloads
(RuntimeConfig.activation_codec / gradient_codec; itself without a codec), any other leaf as
itself. Between stages on one rank the structure is handed over as it is (no codec). The meta
of a forward message (form, per-leaf shape and dtype, which leaves carry gradients, and each
leaf's wire format) is announced through the c10d store the first time an input shape is seen
and checked against that announcement afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from duplexpipe.comm.codec import Codec, IdentityCodec
from duplexpipe.comm.nonfinite import NonFiniteWatch
from duplexpipe.runtime.context import StepContext
from duplexpipe.runtime.stage_compute import Message, TensorMeta
from duplexpipe.runtime.structure import Form
from duplexpipe.runtime.transport import Key, Transport, key_text
from duplexpipe.runtime.watchdog import ActivationShapeError, PipelineError, Watchdog
from duplexpipe.schedules.ir import Action, Op
from duplexpipe.schedules.layout import Layout


def dtype_name(dtype: torch.dtype) -> str:
    """`float32` for torch.float32."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str, where: str) -> torch.dtype:
    """torch.float32 for `float32`; PipelineError naming `where` when unknown."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PipelineError(f"unknown dtype {name!r} announced for {where}")
    return dtype


def wire_of(codec: Codec | None, meta: TensorMeta) -> tuple[TensorMeta, ...]:
    """The payload specs of one leaf: the codec's wire format for a floating leaf, else the leaf itself."""
    if codec is None or not meta.dtype.is_floating_point:
        return (meta,)
    return tuple(codec.wire_format(meta))


@dataclass(frozen=True)
class MessageMeta:
    """What a forward message looks like: its form, each leaf's shape and dtype, which leaves carry a
    gradient back, and the payloads each leaf travels as."""

    form: Form
    """How the leaves rebuild the structure."""
    leaves: tuple[TensorMeta, ...]
    """Shape and dtype of each leaf."""
    grads: tuple[bool, ...]
    """grads[i]: leaf i carries a gradient back."""
    wire: tuple[tuple[TensorMeta, ...], ...] = ()
    """wire[i]: the payload specs leaf i travels as (empty for a message that stays on its rank)."""

    @staticmethod
    def of(message: Message, codec: Codec | None = None) -> MessageMeta:
        """The meta of a message sent with `codec` (None: each leaf as it is)."""
        leaves = tuple(TensorMeta.of(t) for t in message.leaves)
        return MessageMeta(message.form, leaves, message.grads, tuple(wire_of(codec, m) for m in leaves))

    @cached_property
    def payloads(self) -> tuple[TensorMeta, ...]:
        """Every payload's spec, in order (what the receiver allocates); computed once per meta."""
        return tuple(p for wire in self.wire for p in wire)

    @cached_property
    def grad_metas(self) -> tuple[TensorMeta, ...]:
        """Shape and dtype of each gradient of the backward message, in leaf order; computed once per meta."""
        return tuple(m for m, g in zip(self.leaves, self.grads, strict=True) if g)

    def grad_payloads(self, codec: Codec | None) -> tuple[TensorMeta, ...]:
        """The payload specs of the backward message sent with `codec` (computed once per meta and codec)."""
        cached = self.__dict__.get("_grad_payloads")
        if cached is None or cached[0] is not codec:
            cached = (codec, tuple(p for m in self.grad_metas for p in wire_of(codec, m)))
            self.__dict__["_grad_payloads"] = cached
        return cached[1]

    def matches(self, message: Message) -> bool:
        """Whether `message` has exactly this form, these leaf shapes and dtypes and these gradient leaves
        (a cheap check for steps whose shapes were learned; `difference` says what differs)."""
        leaves = message.leaves
        if message.grads != self.grads or message.form != self.form or len(leaves) != len(self.leaves):
            return False
        for tensor, meta in zip(leaves, self.leaves, strict=True):
            if tensor.dtype != meta.dtype or tensor.shape != meta.shape:
                return False
        return True

    def to_json(self) -> str:
        """A compact JSON text."""
        def spec(m: TensorMeta) -> list[Any]:
            return [list(m.shape), dtype_name(m.dtype)]

        return json.dumps([self.form.to_json(), [[*spec(m), g, [spec(p) for p in w]] for m, g, w
                                                 in zip(self.leaves, self.grads, self.wire, strict=True)]])

    @staticmethod
    def from_json(text: str, where: str) -> MessageMeta:
        """Inverse of `to_json`; `where` names the receive in errors."""
        def spec(shape: list[int], dtype: str) -> TensorMeta:
            return TensorMeta(tuple(int(d) for d in shape), parse_dtype(dtype, where))

        form, leaves = json.loads(text)
        return MessageMeta(Form.from_json(form), tuple(spec(shape, dtype) for shape, dtype, _, _ in leaves),
                           tuple(bool(g) for _, _, g, _ in leaves),
                           tuple(tuple(spec(*p) for p in wire) for _, _, _, wire in leaves))

    def difference(self, other: MessageMeta, root: str) -> str:
        """'' when equal, else what differs first, naming the leaf's path below `root`."""
        if self.form != other.form or len(self.leaves) != len(other.leaves):
            return (f"the output {root} has the form {other.form.to_json()} but {self.form.to_json()} "
                    "was expected")
        for i, (want, got) in enumerate(zip(self.leaves, other.leaves, strict=True)):
            if want != got:
                return f"the output {self.form.path(i, root)} has shape {got} but {want} was expected"
        if self.grads != other.grads:
            paths = [self.form.path(i, root) for i, g in enumerate(self.grads) if g]
            return (f"{root}: the leaves that require grad changed (expected exactly {paths}); whether an "
                    "output requires grad must not change between steps with equal input shapes")
        return ""


class MetaBoard:
    """Announces forward messages' metas through the c10d store, for steps with new input shapes."""

    def __init__(self, store: Any, prefix: str, watchdog: Watchdog) -> None:
        self.store = store
        self.prefix = prefix
        self.watchdog = watchdog

    def _key(self, step: int, stage: int, microbatch: int) -> str:
        return f"{self.prefix}/meta/{step}/{stage}/{microbatch}"

    def announce(self, step: int, stage: int, microbatch: int, meta: MessageMeta) -> None:
        """Publish the meta of the message stage `stage` receives for `microbatch`."""
        self.store.set(self._key(step, stage, microbatch), meta.to_json())

    def lookup(self, step: int, stage: int, microbatch: int, block: bool, peer: int) -> MessageMeta | None:
        """The announced meta, None if not announced yet (unless block: then wait, bounded)."""
        key = self._key(step, stage, microbatch)
        if not self.store.check([key]):
            if not block:
                return None
            self.watchdog.wait(lambda: bool(self.store.check([key])),
                               f"the shape announcement of {stage}RECV_F{microbatch} (the input of "
                               f"{stage}F{microbatch})", f"rank {peer}")
        text = self.store.get(key).decode()
        self.store.delete_key(key)
        return MessageMeta.from_json(text, f"{stage}RECV_F{microbatch}")


class Mailroom:
    """Moves messages between stages: local handoffs, or announce + send / receive over the transport."""

    def __init__(self, layout: Layout, rank: int, transport: Transport, board: MetaBoard,
                 activation_codec: Codec | None = None, gradient_codec: Codec | None = None,
                 watch: NonFiniteWatch | None = None) -> None:
        self.layout = layout
        self.watch = watch
        self.rank = rank
        self.transport = transport
        self.board = board
        self.activation_codec = None if isinstance(activation_codec, IdentityCodec) else activation_codec
        self.gradient_codec = None if isinstance(gradient_codec, IdentityCodec) else gradient_codec

    def _encode(self, codec: Codec | None, leaves: list[Tensor], wire: tuple[tuple[TensorMeta, ...], ...],
                where: str) -> list[Tensor]:
        """The payloads of `leaves` (detached), checked against their wire format."""
        if codec is None:
            return leaves
        out: list[Tensor] = []
        for leaf, want in zip(leaves, wire, strict=True):
            if not leaf.is_floating_point():
                out.append(leaf)
                continue
            payloads = codec.encode(leaf)
            if tuple(TensorMeta.of(p) for p in payloads) != want:
                got = [str(TensorMeta.of(p)) for p in payloads]
                raise PipelineError(f"{where}: codec {codec.name!r} encoded {TensorMeta.of(leaf)} into {got}, "
                                    f"not its wire format {[str(w) for w in want]}")
            if self.watch is not None:  # NaN/inf must be reported, and arrive non-finite
                self.watch.note(codec, leaf, payloads, f"rank {self.rank}: {where}")
            out.extend(payloads)
        return out

    def _decode(self, codec: Codec | None, payloads: list[Tensor], metas: tuple[TensorMeta, ...],
                wire: tuple[tuple[TensorMeta, ...], ...]) -> list[Tensor]:
        """The leaves rebuilt from their received payloads."""
        if codec is None:
            return payloads
        leaves, at = [], 0
        for meta, specs in zip(metas, wire, strict=True):
            mine = payloads[at:at + len(specs)]
            at += len(specs)
            leaves.append(codec.decode(mine, meta) if meta.dtype.is_floating_point else mine[0])
        return leaves

    # ---------------------------------------------------------------- forward messages
    def hand_on(self, ctx: StepContext, stage: int, mb: int, message: Message) -> None:
        """Give `stage`'s output of `mb` to the next stage: locally, or to the outbox of its SEND_F."""
        nxt = self.layout.nxt[stage]
        detached = [t.detach() for t in message.leaves]
        if self.layout.peer(stage, backward=False) < 0:
            ctx.local_fwd[(nxt, mb)] = Message(message.form, detached, message.grads)
            return
        expected = None if ctx.learning else ctx.shapes.get((nxt, mb))
        if expected is not None and expected.matches(message):
            meta = expected  # shapes learned: nothing to build or announce
        else:
            meta = MessageMeta.of(message, self.activation_codec)
            if ctx.learning:
                ctx.shapes[(nxt, mb)] = meta
                self.board.announce(ctx.step, nxt, mb, meta)
            else:
                problem = "no message was announced" if expected is None else expected.difference(meta, "out")
                raise ActivationShapeError(
                    f"stage {stage} microbatch {mb}: {problem or 'the message changed'} (announced the first "
                    "time these input shapes were seen; a stage's output shapes must depend only on its input "
                    "shapes)")
        if ctx.train:
            ctx.out_meta[(stage, mb)] = meta
        ctx.outbox[(Op.SEND_F, stage, mb)] = (
            detached if self.activation_codec is None else
            self._encode(self.activation_codec, detached, meta.wire, f"stage {stage} microbatch {mb}"))

    def expect_input(self, ctx: StepContext, action: Action) -> None:
        """RECV_F: queue the receive; its payloads' shapes come from the cache or the announcement."""
        stage, mb = action.stage, action.microbatch
        peer = self.layout.rank[self.layout.prv[stage]]

        def resolve(block: bool) -> tuple[TensorMeta, ...] | None:
            if not ctx.learning:
                meta = ctx.shapes.get((stage, mb))
                if meta is None:
                    raise PipelineError(f"rank {self.rank}: no shape is known for {action}")
                return meta.payloads
            found = self.board.lookup(ctx.step, stage, mb, block, peer)
            if found is None:
                return None
            ctx.shapes[(stage, mb)] = found
            return found.payloads

        self.transport.expect((Op.RECV_F, stage, mb), peer, resolve)

    def take_input(self, ctx: StepContext, stage: int, mb: int, consumer: Action) -> Message:
        """The message `stage` consumes for `mb`: the batch's rows, a local handoff or a receive."""
        prev = self.layout.prv[stage]
        if prev < 0:
            if mb not in ctx.inputs:
                raise PipelineError(f"rank {self.rank}: {consumer} has no input rows for microbatch {mb}")
            return ctx.inputs[mb]
        if self.layout.rank[prev] == self.rank:
            if (stage, mb) not in ctx.local_fwd:
                raise PipelineError(f"rank {self.rank}: {consumer} runs before {prev}F{mb} produced its input")
            return ctx.local_fwd.pop((stage, mb))
        payloads = self.transport.take((Op.RECV_F, stage, mb), consumer)
        meta = ctx.shapes[(stage, mb)]
        return Message(meta.form, self._decode(self.activation_codec, payloads, meta.leaves, meta.wire),
                       meta.grads)

    # ---------------------------------------------------------------- backward messages
    def hand_back(self, ctx: StepContext, stage: int, mb: int, grads: list[Tensor]) -> None:
        """Give the input gradients of `stage` for `mb` to the previous stage (nothing on a first stage)."""
        prev = self.layout.prv[stage]
        if prev < 0:
            return
        if self.layout.peer(stage, backward=True) < 0:
            ctx.local_grad[(prev, mb)] = grads
        elif self.gradient_codec is None:
            ctx.outbox[(Op.SEND_B, stage, mb)] = grads
        else:
            wire = tuple(wire_of(self.gradient_codec, TensorMeta.of(g)) for g in grads)
            ctx.outbox[(Op.SEND_B, stage, mb)] = self._encode(self.gradient_codec, grads, wire,
                                                              f"stage {stage} microbatch {mb} (gradients)")

    def expect_grads(self, ctx: StepContext, action: Action) -> None:
        """RECV_B: queue the receive of the gradients of what this stage sent for the microbatch."""
        stage, mb = action.stage, action.microbatch

        def resolve(block: bool) -> tuple[TensorMeta, ...] | None:
            meta = ctx.out_meta.get((stage, mb))
            if meta is None and not ctx.learning:  # the learned output (hand_on checks the output against it)
                meta = ctx.shapes.get((self.layout.nxt[stage], mb))
            if meta is None and block:
                raise PipelineError(f"rank {self.rank}: {action} is consumed before {stage}F{mb} ran")
            if meta is None:
                return None
            return meta.grad_payloads(self.gradient_codec)

        self.transport.expect((Op.RECV_B, stage, mb), self.layout.rank[self.layout.nxt[stage]], resolve)

    def take_grads(self, ctx: StepContext, stage: int, mb: int, consumer: Action) -> list[Tensor] | None:
        """The gradients of `stage`'s gradient-carrying outputs for `mb` (None on a last stage)."""
        nxt = self.layout.nxt[stage]
        if nxt < 0:
            return None
        if self.layout.rank[nxt] != self.rank:
            payloads = self.transport.take((Op.RECV_B, stage, mb), consumer)
            metas = ctx.out_meta.pop((stage, mb)).grad_metas
            if self.gradient_codec is None:
                return payloads
            wire = tuple(wire_of(self.gradient_codec, m) for m in metas)
            return self._decode(self.gradient_codec, payloads, metas, wire)
        if (stage, mb) not in ctx.local_grad:
            raise PipelineError(f"rank {self.rank}: {consumer} runs before stage {nxt}'s backward of "
                                f"microbatch {mb} produced its gradient")
        return ctx.local_grad.pop((stage, mb))

    # ---------------------------------------------------------------- sends
    def send(self, ctx: StepContext, action: Action) -> None:
        """SEND_F / SEND_B: post the payloads its producer left in the outbox."""
        key: Key = (action.op, action.stage, action.microbatch)
        payloads = ctx.outbox.pop(key, None)
        if payloads is None:
            raise PipelineError(f"rank {self.rank}: {action} runs before the compute that produces its tensor")
        peer = self.layout.peer(action.stage, backward=action.op is Op.SEND_B)
        if peer < 0:
            raise PipelineError(f"rank {self.rank}: {key_text(key)} has no peer on another rank")
        self.transport.send(key, payloads, peer)

