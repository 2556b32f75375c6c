"""A message between stages (`Message`) and what it looks like (`MessageMeta`): form, leaf specs, wire format.

Which leaves go through the activation codec is part of the meta, so sender and receiver agree: only
floating leaves that carry a gradient back (activations that require grad) are encoded; forward-only
tensors (masks, positions, flags) travel exactly, and so does a leaf that held NaN, inf or a float
extreme when the meta was built (the sender decides, the announcement tells the receiver).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from duplexpipe.comm.codec import Codec, TensorSpec
from duplexpipe.errors import PipelineError
from duplexpipe.runtime.structure import TENSOR, Form, describe, form_from_json, form_to_json, paths


def dtype_name(dtype: torch.dtype) -> str:
    """`float32` for torch.float32."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str, where: str) -> torch.dtype:
    """torch.float32 for `float32`; PipelineError naming `where` when unknown."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PipelineError(f"unknown dtype {name!r} announced for {where}")
    return dtype


def wire_of(codec: Codec | None, meta: TensorSpec) -> tuple[TensorSpec, ...]:
    """The payload specs of one tensor: the codec's wire format for a floating tensor, else the tensor itself."""
    if codec is None or not meta.dtype.is_floating_point:
        return (meta,)
    return tuple(codec.wire_format(meta))


def encodes(codec: Codec | None, meta: TensorSpec, grad: bool) -> bool:
    """Whether a leaf of a forward message may go through `codec`: a floating leaf that carries a gradient
    back. Forward-only tensors (masks, positions, flags) travel exactly."""
    return codec is not None and grad and meta.dtype.is_floating_point


@dataclass
class Message:
    """A structure passed between two stages: its form, its leaves, and which leaves carry a
    gradient back (floating tensors that required grad where they were produced)."""

    form: Form
    """How the leaves rebuild the structure."""
    leaves: list[Tensor]
    """The tensors, in leaf order."""
    grads: tuple[bool, ...]
    """grads[i]: leaf i gets a gradient message back."""

    @staticmethod
    def single(tensor: Tensor) -> Message:
        """One tensor that carries no gradient (e.g. a first stage's input)."""
        return Message(TENSOR, [tensor], (False,))


@dataclass(frozen=True)
class MessageMeta:
    """What a forward message looks like: its form, each leaf's shape and dtype, which leaves carry a
    gradient back, which go through the codec, and the payloads each leaf travels as."""

    form: Form
    """How the leaves rebuild the structure."""
    leaves: tuple[TensorSpec, ...]
    """Shape and dtype of each leaf."""
    grads: tuple[bool, ...]
    """grads[i]: leaf i carries a gradient back."""
    wire: tuple[tuple[TensorSpec, ...], ...] = ()
    """wire[i]: the payload specs leaf i travels as (empty for a message that stays on its rank)."""
    coded: tuple[bool, ...] = ()
    """coded[i]: leaf i travels through the activation codec (else exactly; empty: none does)."""

    @staticmethod
    def of(message: Message, codec: Codec | None = None, exact: Sequence[bool] = ()) -> MessageMeta:
        """The meta of a message sent with `codec` (None: each leaf as it is); `exact[i]` keeps leaf i out of
        the codec even where `encodes` allows it."""
        leaves = tuple(TensorSpec.of(t) for t in message.leaves)
        keep = tuple(exact) or (False,) * len(leaves)
        coded = tuple(encodes(codec, m, g) and not k for m, g, k in zip(leaves, message.grads, keep, strict=True))
        wire = tuple(wire_of(codec if c else None, m) for m, c in zip(leaves, coded, strict=True))
        return MessageMeta(message.form, leaves, message.grads, wire, coded)

    def rewired(self, codec: Codec | None) -> MessageMeta:
        """This meta with the coded leaves travelling through `codec` (None: as they are): an adaptive link's rung
        of the running step (computed once per meta and codec)."""
        cache = self.__dict__.setdefault("_rewired", {})
        if id(codec) not in cache:
            coded = self.coded or (False,) * len(self.leaves)
            wire = tuple(wire_of(codec if c else None, m) for m, c in zip(self.leaves, coded, strict=True))
            cache[id(codec)] = (codec, replace(self, wire=wire))
        return cache[id(codec)][1]  # type: ignore[no-any-return]

    @cached_property
    def payloads(self) -> tuple[TensorSpec, ...]:
        """Every payload's spec, in order (what the receiver allocates); computed once per meta."""
        return tuple(p for wire in self.wire for p in wire)

    @cached_property
    def held_back(self) -> int:
        """Leaves a codec could encode (floating, carrying a gradient) that travel exactly instead."""
        coded = self.coded or (False,) * len(self.leaves)
        return sum(g and m.dtype.is_floating_point and not c for m, g, c in zip(self.leaves, self.grads, coded,
                                                                               strict=True))

    @cached_property
    def grad_metas(self) -> tuple[TensorSpec, ...]:
        """Shape and dtype of each gradient of the backward message, in leaf order; computed once per meta."""
        return tuple(m for m, g in zip(self.leaves, self.grads, strict=True) if g)

    def grad_payloads(self, codec: Codec | None) -> tuple[TensorSpec, ...]:
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
        def spec(m: TensorSpec) -> list[Any]:
            return [list(m.shape), dtype_name(m.dtype)]

        coded = self.coded or (False,) * len(self.leaves)
        return json.dumps([form_to_json(self.form), [[*spec(m), g, [spec(p) for p in w], c] for m, g, w, c
                                                      in zip(self.leaves, self.grads, self.wire, coded, strict=True)]])

    @staticmethod
    def from_json(text: str, where: str) -> MessageMeta:
        """Inverse of `to_json`; `where` names the receive in errors."""
        def spec(shape: list[int], dtype: str) -> TensorSpec:
            return TensorSpec(tuple(int(d) for d in shape), parse_dtype(dtype, where))

        form, leaves = json.loads(text)
        return MessageMeta(form_from_json(form), tuple(spec(shape, dtype) for shape, dtype, *_ in leaves),
                           tuple(bool(leaf[2]) for leaf in leaves),
                           tuple(tuple(spec(*p) for p in leaf[3]) for leaf in leaves),
                           tuple(bool(leaf[4]) for leaf in leaves))

    def difference(self, other: MessageMeta, root: str) -> str:
        """'' when equal, else what differs first, naming the leaf's path below `root`."""
        if self.form != other.form or len(self.leaves) != len(other.leaves):
            return f"the output {root} has the form of {describe(other.form)} but {describe(self.form)} was expected"
        named = paths(self.form, root)
        for path, want, got in zip(named, self.leaves, other.leaves, strict=True):
            if want != got:
                return f"the output {path} has shape {got} but {want} was expected"
        if self.grads != other.grads:
            wanted = [p for p, g in zip(named, self.grads, strict=True) if g]
            return (f"{root}: the leaves that require grad changed (expected exactly {wanted}); whether an "
                    "output requires grad must not change between steps with equal input shapes")
        return ""
