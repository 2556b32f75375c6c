"""Message plumbing: tensor structures between stages, their announcements, local handoffs and transport.

A forward message is the structure one stage hands the next (a tensor, a tuple/list or a
flat dict); a backward message is the list of gradients of the leaves that carry one back
(floating tensors that required grad), in leaf order. Between ranks every leaf travels as
its own tensor, keyed by the SEND/RECV action; between stages on one rank the structure is
handed over as it is. The meta of a forward message (form, per-leaf shape and dtype, which
leaves carry gradients) is announced through the c10d store the first time an input shape
is seen and checked against that announcement afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

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


@dataclass(frozen=True)
class MessageMeta:
    """What a forward message looks like: its form, each leaf's shape and dtype, and which leaves
    carry a gradient back."""

    form: Form
    """How the leaves rebuild the structure."""
    leaves: tuple[TensorMeta, ...]
    """Shape and dtype of each leaf."""
    grads: tuple[bool, ...]
    """grads[i]: leaf i carries a gradient back."""

    @staticmethod
    def of(message: Message) -> MessageMeta:
        """The meta of a message."""
        return MessageMeta(message.form, tuple(TensorMeta.of(t) for t in message.leaves), message.grads)

    @property
    def grad_metas(self) -> tuple[TensorMeta, ...]:
        """Shape and dtype of each gradient of the backward message, in leaf order."""
        return tuple(m for m, g in zip(self.leaves, self.grads, strict=True) if g)

    def to_json(self) -> str:
        """A compact JSON text."""
        return json.dumps([self.form.to_json(), [[list(m.shape), dtype_name(m.dtype), g]
                                                 for m, g in zip(self.leaves, self.grads, strict=True)]])

    @staticmethod
    def from_json(text: str, where: str) -> MessageMeta:
        """Inverse of `to_json`; `where` names the receive in errors."""
        form, leaves = json.loads(text)
        metas = tuple(TensorMeta(tuple(int(d) for d in shape), parse_dtype(dtype, where))
                      for shape, dtype, _ in leaves)
        return MessageMeta(Form.from_json(form), metas, tuple(bool(g) for _, _, g in leaves))

    def difference(self, other: MessageMeta, root: str) -> str:
        """'' when equal, else what differs first, naming the leaf's path below `root`."""
        if self.form != other.form:
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

    def __init__(self, layout: Layout, rank: int, transport: Transport, board: MetaBoard) -> None:
        self.layout = layout
        self.rank = rank
        self.transport = transport
        self.board = board

    # ---------------------------------------------------------------- forward messages
    def hand_on(self, ctx: StepContext, stage: int, mb: int, message: Message) -> None:
        """Give `stage`'s output of `mb` to the next stage: locally, or to the outbox of its SEND_F."""
        nxt = self.layout.nxt[stage]
        detached = [t.detach() for t in message.leaves]
        if self.layout.peer(stage, backward=False) < 0:
            ctx.local_fwd[(nxt, mb)] = Message(message.form, detached, message.grads)
            return
        meta = MessageMeta.of(message)
        if ctx.learning:
            ctx.shapes[(nxt, mb)] = meta
            self.board.announce(ctx.step, nxt, mb, meta)
        else:
            expected = ctx.shapes.get((nxt, mb))
            problem = "no message was announced" if expected is None else expected.difference(meta, "out")
            if problem:
                raise ActivationShapeError(
                    f"stage {stage} microbatch {mb}: {problem} (announced the first time these input shapes "
                    "were seen; a stage's output shapes must depend only on its input shapes)")
        if ctx.train:
            ctx.out_meta[(stage, mb)] = meta
        ctx.outbox[(Op.SEND_F, stage, mb)] = detached

    def expect_input(self, ctx: StepContext, action: Action) -> None:
        """RECV_F: queue the receive; its payloads' shapes come from the cache or the announcement."""
        stage, mb = action.stage, action.microbatch
        peer = self.layout.rank[self.layout.prv[stage]]

        def resolve(block: bool) -> tuple[TensorMeta, ...] | None:
            if not ctx.learning:
                meta = ctx.shapes.get((stage, mb))
                if meta is None:
                    raise PipelineError(f"rank {self.rank}: no shape is known for {action}")
                return meta.leaves
            found = self.board.lookup(ctx.step, stage, mb, block, peer)
            if found is None:
                return None
            ctx.shapes[(stage, mb)] = found
            return found.leaves

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
        leaves = self.transport.take((Op.RECV_F, stage, mb), str(consumer))
        meta = ctx.shapes[(stage, mb)]
        return Message(meta.form, leaves, meta.grads)

    # ---------------------------------------------------------------- backward messages
    def hand_back(self, ctx: StepContext, stage: int, mb: int, grads: list[Tensor]) -> None:
        """Give the input gradients of `stage` for `mb` to the previous stage (nothing on a first stage)."""
        prev = self.layout.prv[stage]
        if prev < 0:
            return
        if self.layout.peer(stage, backward=True) < 0:
            ctx.local_grad[(prev, mb)] = grads
        else:
            ctx.outbox[(Op.SEND_B, stage, mb)] = grads

    def expect_grads(self, ctx: StepContext, action: Action) -> None:
        """RECV_B: queue the receive of the gradients of what this stage sent for the microbatch."""
        stage, mb = action.stage, action.microbatch

        def resolve(block: bool) -> tuple[TensorMeta, ...] | None:
            meta = ctx.out_meta.get((stage, mb))
            if meta is None and block:
                raise PipelineError(f"rank {self.rank}: {action} is consumed before {stage}F{mb} ran")
            return None if meta is None else meta.grad_metas

        self.transport.expect((Op.RECV_B, stage, mb), self.layout.rank[self.layout.nxt[stage]], resolve)

    def take_grads(self, ctx: StepContext, stage: int, mb: int, consumer: Action) -> list[Tensor] | None:
        """The gradients of `stage`'s gradient-carrying outputs for `mb` (None on a last stage)."""
        nxt = self.layout.nxt[stage]
        if nxt < 0:
            return None
        if self.layout.rank[nxt] != self.rank:
            grads = self.transport.take((Op.RECV_B, stage, mb), str(consumer))
            del ctx.out_meta[(stage, mb)]
            return grads
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

