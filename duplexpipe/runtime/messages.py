"""The mail between stages: messages and their announcements (Mailroom), a step's Mailbox, the transport under them.

A forward message is the structure one stage hands the next (a tensor, or tuples/lists/dicts of
tensors); a backward message is the list of gradients of the leaves that carry one back (floating
tensors that required grad), in leaf order. Between ranks every leaf travels as its payload tensors,
keyed by the SEND/RECV action: a gradient-carrying leaf of a forward message and every gradient as its
codec's payloads (RuntimeConfig.activation_codec / gradient_codec), any other leaf as itself (masks,
positions, flags: forward-only tensors travel exactly, and so does a gradient-carrying leaf that held
NaN, inf or a float extreme when its meta was built, counted in `NonFiniteWatch.exact_sends`). Between
stages on one rank the structure is handed over as it is (no codec). The meta of a forward message
(`MessageMeta`: form, per-leaf shape and dtype, which leaves carry gradients, which go through the codec,
and each leaf's wire format) is announced through the c10d store the first time an input shape is seen
and checked against that announcement afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from duplexpipe.comm.adaptive_links import AdaptiveCodec
from duplexpipe.comm.codec import Codec, TensorSpec, sends_as_is
from duplexpipe.comm.nonfinite import NonFiniteWatch, Unread, extremes
from duplexpipe.errors import ActivationShapeError, PipelineError
from duplexpipe.runtime.message_meta import Message, MessageMeta, encodes, wire_of
from duplexpipe.runtime.structure import paths
from duplexpipe.runtime.transport import Key, MailTransport, key_text
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.ir import Action, Op
from duplexpipe.schedules.layout import Layout

Slot = tuple[int, int]
"""(stage, microbatch)."""


@dataclass(eq=False)
class Mailbox:
    """One step's mail on one rank: local handoffs, the outbox of payloads waiting for their SEND, the metas of sent
    outputs (the gradients coming back), the message metas learned or checked against, and the non-finite counts
    still to read. Held by the step: a new step (or a failed one) starts with an empty one."""

    step: int
    """The step running (names its shape announcements)."""
    train: bool
    """Whether it trains (only then are sent outputs' metas kept for the gradients coming back)."""
    shapes: dict[Slot, MessageMeta] = field(default_factory=dict)
    """(receiving stage, microbatch) -> the forward message's meta: known, or filled while learning."""
    learning: bool = True
    """True when the step's message metas are learned and announced (new input shapes)."""
    local_fwd: dict[Slot, Message] = field(default_factory=dict)
    """Activations handed to the next stage on this rank: (consumer stage, microbatch)."""
    local_grad: dict[Slot, list[Tensor]] = field(default_factory=dict)
    """Output gradients handed to the previous stage on this rank: (consumer stage, microbatch)."""
    outbox: dict[Key, list[Tensor]] = field(default_factory=dict)
    """Payloads produced for a SEND action that has not run yet."""
    out_meta: dict[Slot, MessageMeta] = field(default_factory=dict)
    """The meta of each output this rank sent to another rank (the gradients it will receive)."""
    unread: list[Unread] = field(default_factory=list)
    """Non-finite counts of accelerator tensors sent, read at the step's end (`NonFiniteWatch.read`)."""

    @classmethod
    def of(cls, step: int, train: bool, shapes: dict[Slot, MessageMeta] | None) -> Mailbox:
        """An empty mailbox for step `step`. `shapes`: the message metas learned for these input shapes (kept as
        they are), or None to learn them now (each announced through the store)."""
        return cls(step, train, {} if shapes is None else shapes, shapes is None)

    def held(self) -> list[Tensor]:
        """The tensors its messages hold now: local handoffs not yet consumed and payloads waiting for their SEND."""
        held = [t for message in self.local_fwd.values() for t in message.leaves]
        held += [t for grads in self.local_grad.values() for t in grads if t is not None]
        held += [t for payloads in self.outbox.values() for t in payloads]
        return held

    def leftovers(self) -> list[str]:
        """Descriptions of messages the step left unconsumed (empty after a complete step)."""
        found = []
        if self.outbox:
            found.append("produced but never sent: " + ", ".join(
                f"{s}{op.value}{m}" for op, s, m in sorted(self.outbox, key=lambda k: (k[1], k[2]))))
        for name, table in (("activations", self.local_fwd), ("gradients", self.local_grad)):
            if table:
                found.append(f"local {name} never consumed: " +
                             ", ".join(f"stage {s} microbatch {m}" for s, m in sorted(table)))
        return found


class Mailroom:
    """The message path of one rank: local handoffs, or announce + send / receive over its `MailTransport`. Every
    method works on the running step's `Mailbox`; the mailroom keeps only what outlives a step (layout, codecs,
    the transport, the store the metas are announced through)."""

    def __init__(self, layout: Layout, rank: int, transport: MailTransport, store: Any, prefix: str,
                 watchdog: Watchdog, activation_codec: Codec | None = None, gradient_codec: Codec | None = None,
                 watch: NonFiniteWatch | None = None) -> None:
        self.layout = layout
        self.watch = watch
        self.rank = rank
        self.transport = transport
        self.store = store
        self.prefix = prefix
        self.watchdog = watchdog
        self.activation_codec = None if sends_as_is(activation_codec) else activation_codec
        self.gradient_codec = None if sends_as_is(gradient_codec) else gradient_codec

    # ---------------------------------------------------------------- announcements (new input shapes)
    def _key(self, step: int, stage: int, microbatch: int) -> str:
        return f"{self.prefix}/meta/{step}/{stage}/{microbatch}"

    def announce(self, step: int, stage: int, microbatch: int, meta: MessageMeta) -> None:
        """Publish the meta of the message stage `stage` receives for `microbatch` (through the c10d store)."""
        self.store.set(self._key(step, stage, microbatch), meta.to_json())

    def announced(self, step: int, stage: int, microbatch: int, block: bool, peer: int) -> MessageMeta | None:
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

    def _link_codec(self, codec: Codec | None, src: int, dst: int) -> Codec | None:
        """The codec of the directed link src -> dst (ranks) in this step: an adaptive codec's rung there, else
        `codec` itself."""
        return codec.for_link(src, dst) if isinstance(codec, AdaptiveCodec) else codec

    def _wired(self, meta: MessageMeta, codec: Codec | None) -> MessageMeta:
        """`meta` as it travels with the link's `codec` (adaptive links rewire it to their rung)."""
        return meta.rewired(codec) if isinstance(self.activation_codec, AdaptiveCodec) else meta

    def _encode(self, box: Mailbox, codec: Codec | None, leaves: list[Tensor],
                wire: tuple[tuple[TensorSpec, ...], ...], coded: tuple[bool, ...] | None, where: str) -> list[Tensor]:
        """The payloads of `leaves` (detached), checked against their wire format; `coded[i]`: leaf i goes
        through the codec (None: every floating leaf does)."""
        if codec is None:
            return leaves
        out: list[Tensor] = []
        for i, (leaf, want) in enumerate(zip(leaves, wire, strict=True)):
            if not (leaf.is_floating_point() if coded is None else coded[i]):
                out.append(leaf)
                continue
            payloads = codec.encode(leaf)
            if tuple(TensorSpec.of(p) for p in payloads) != want:
                got = [str(TensorSpec.of(p)) for p in payloads]
                raise PipelineError(f"{where}: codec {codec.name!r} encoded {TensorSpec.of(leaf)} into {got}, "
                                    f"not its wire format {[str(w) for w in want]}")
            if self.watch is not None:  # NaN/inf must be reported, and arrive non-finite
                self.watch.note(codec, leaf, payloads, f"rank {self.rank}: {where}", box.unread)
            out.extend(payloads)
        return out

    def _decode(self, codec: Codec | None, payloads: list[Tensor], metas: tuple[TensorSpec, ...],
                wire: tuple[tuple[TensorSpec, ...], ...], coded: tuple[bool, ...] | None) -> list[Tensor]:
        """The leaves rebuilt from their received payloads (`coded` as in `_encode`)."""
        if codec is None:
            return payloads
        leaves, at = [], 0
        for i, (meta, specs) in enumerate(zip(metas, wire, strict=True)):
            mine = payloads[at:at + len(specs)]
            at += len(specs)
            use = meta.dtype.is_floating_point if coded is None else coded[i]
            leaves.append(codec.decode(mine, meta) if use else mine[0])
        return leaves

    def _meta(self, message: Message, where: str) -> MessageMeta:
        """The meta of an outgoing message: a leaf the codec may encode goes exactly instead when it holds
        NaN, inf or a float extreme now (one count per such leaf, read at once: only when shapes are
        learned), reported to the watch."""
        codec, exact = self.activation_codec, [False] * len(message.leaves)
        for i, (leaf, grad) in enumerate(zip(message.leaves, message.grads, strict=True)):
            if encodes(codec, TensorSpec.of(leaf), grad):
                count = int(extremes(leaf))
                exact[i] = count > 0
                if count and self.watch is not None and codec is not None:
                    self.watch.kept_exact(codec, leaf, count, f"rank {self.rank}: {where}",
                                          paths(message.form, "out")[i])
        return MessageMeta.of(message, codec, exact)

    # ---------------------------------------------------------------- forward messages
    def hand_on(self, box: Mailbox, stage: int, mb: int, message: Message) -> None:
        """Give `stage`'s output of `mb` to the next stage: locally, or to the outbox of its SEND_F."""
        nxt = self.layout.nxt[stage]
        detached = [t.detach() for t in message.leaves]
        if self.layout.peer(stage, backward=False) < 0:
            box.local_fwd[(nxt, mb)] = Message(message.form, detached, message.grads)
            return
        where = f"stage {stage} microbatch {mb}"
        expected = None if box.learning else box.shapes.get((nxt, mb))
        if expected is not None and expected.matches(message):
            meta = expected  # shapes learned: nothing to build or announce
        elif box.learning:
            meta = self._meta(message, where)
            box.shapes[(nxt, mb)] = meta
            self.announce(box.step, nxt, mb, meta)
        else:
            problem = ("no message was announced" if expected is None else
                       expected.difference(MessageMeta.of(message), "out"))
            raise ActivationShapeError(
                f"{where}: {problem or 'the message changed'} (announced the first time these input shapes "
                "were seen; a stage's output shapes must depend only on its input shapes)")
        if box.train:
            box.out_meta[(stage, mb)] = meta
        codec = self._link_codec(self.activation_codec, self.rank, self.layout.rank[nxt])
        if codec is None:
            box.outbox[(Op.SEND_F, stage, mb)] = detached
            return
        box.outbox[(Op.SEND_F, stage, mb)] = self._encode(box, codec, detached, self._wired(meta, codec).wire,
                                                         meta.coded, where)
        if meta.held_back and self.watch is not None:
            self.watch.exact_sends += meta.held_back

    def expect_input(self, box: Mailbox, action: Action) -> None:
        """RECV_F: queue the receive; its payloads' shapes come from the cache or the announcement."""
        stage, mb = action.stage, action.microbatch
        peer = self.layout.rank[self.layout.prv[stage]]
        learning, shapes, step = box.learning, box.shapes, box.step
        codec = self._link_codec(self.activation_codec, peer, self.rank)

        def resolve(block: bool) -> tuple[TensorSpec, ...] | None:
            if not learning:
                meta = shapes.get((stage, mb))
                if meta is None:
                    raise PipelineError(f"rank {self.rank}: no shape is known for {action}")
                return self._wired(meta, codec).payloads
            found = self.announced(step, stage, mb, block, peer)
            if found is None:
                return None
            shapes[(stage, mb)] = found
            return self._wired(found, codec).payloads

        self.transport.expect((Op.RECV_F, stage, mb), peer, resolve)

    def take_input(self, box: Mailbox, stage: int, mb: int, consumer: Action) -> Message:
        """The message `stage` (not a first stage) consumes for `mb`: a local handoff or a receive."""
        prev = self.layout.prv[stage]
        if self.layout.rank[prev] == self.rank:
            message = box.local_fwd.pop((stage, mb), None)
            if message is None:
                raise PipelineError(f"rank {self.rank}: {consumer} runs before {prev}F{mb} produced its input")
            return message
        payloads = self.transport.take((Op.RECV_F, stage, mb), consumer)
        meta = box.shapes[(stage, mb)]
        codec = self._link_codec(self.activation_codec, self.layout.rank[prev], self.rank)
        return Message(meta.form, self._decode(codec, payloads, meta.leaves, self._wired(meta, codec).wire,
                                               meta.coded), meta.grads)

    # ---------------------------------------------------------------- backward messages
    def hand_back(self, box: Mailbox, stage: int, mb: int, grads: list[Tensor]) -> None:
        """Give the input gradients of `stage` for `mb` to the previous stage (nothing on a first stage)."""
        prev = self.layout.prv[stage]
        if prev < 0:
            return
        if self.layout.peer(stage, backward=True) < 0:
            box.local_grad[(prev, mb)] = grads
            return
        codec = self._link_codec(self.gradient_codec, self.rank, self.layout.rank[prev])
        if codec is None:
            box.outbox[(Op.SEND_B, stage, mb)] = grads
        else:
            wire = tuple(wire_of(codec, TensorSpec.of(g)) for g in grads)
            box.outbox[(Op.SEND_B, stage, mb)] = self._encode(box, codec, grads, wire, None,
                                                             f"stage {stage} microbatch {mb} (gradients)")

    def expect_grads(self, box: Mailbox, action: Action) -> None:
        """RECV_B: queue the receive of the gradients of what this stage sent for the microbatch."""
        stage, mb = action.stage, action.microbatch
        out_meta, learning, shapes = box.out_meta, box.learning, box.shapes
        codec = self._link_codec(self.gradient_codec, self.layout.rank[self.layout.nxt[stage]], self.rank)

        def resolve(block: bool) -> tuple[TensorSpec, ...] | None:
            meta = out_meta.get((stage, mb))
            if meta is None and not learning:  # the learned output (hand_on checks the output against it)
                meta = shapes.get((self.layout.nxt[stage], mb))
            if meta is None and block:
                raise PipelineError(f"rank {self.rank}: {action} is consumed before {stage}F{mb} ran")
            if meta is None:
                return None
            return meta.grad_payloads(codec)

        self.transport.expect((Op.RECV_B, stage, mb), self.layout.rank[self.layout.nxt[stage]], resolve)

    def take_grads(self, box: Mailbox, stage: int, mb: int, consumer: Action) -> list[Tensor] | None:
        """The gradients of `stage`'s gradient-carrying outputs for `mb` (None on a last stage)."""
        nxt = self.layout.nxt[stage]
        if nxt < 0:
            return None
        if self.layout.rank[nxt] != self.rank:
            payloads = self.transport.take((Op.RECV_B, stage, mb), consumer)
            metas = box.out_meta.pop((stage, mb)).grad_metas
            codec = self._link_codec(self.gradient_codec, self.layout.rank[nxt], self.rank)
            if codec is None:
                return payloads
            wire = tuple(wire_of(codec, m) for m in metas)
            return self._decode(codec, payloads, metas, wire, None)
        grads = box.local_grad.pop((stage, mb), None)
        if grads is None:
            raise PipelineError(f"rank {self.rank}: {consumer} runs before stage {nxt}'s backward of "
                                f"microbatch {mb} produced its gradient")
        return grads

    # ---------------------------------------------------------------- sends
    def send(self, box: Mailbox, action: Action) -> None:
        """SEND_F / SEND_B: post the payloads its producer left in the outbox."""
        key: Key = (action.op, action.stage, action.microbatch)
        payloads = box.outbox.pop(key, None)
        if payloads is None:
            raise PipelineError(f"rank {self.rank}: {action} runs before the compute that produces its tensor")
        peer = self.layout.peer(action.stage, backward=action.op is Op.SEND_B)
        if peer < 0:
            raise PipelineError(f"rank {self.rank}: {key_text(key)} has no peer on another rank")
        self.transport.send(key, payloads, peer)

