"""The transport-codec protocol: one outgoing floating tensor <-> payload tensors on the wire.

A codec turns a tensor into one or more payload tensors before a stage-to-stage send and
rebuilds the tensor from them after the receive. The runtime applies one codec to forward
activations and one to backward gradients (RuntimeConfig.activation_codec / gradient_codec);
integer tensors (masks, ids) are never encoded. Tensors are described by shape and dtype only
(TensorSpec): `wire_format(spec)` must be a pure function of the spec, because the receiver
allocates its buffers from it (the payload specs are announced like any tensor's), and
`name` identifies the codec and its parameters in the start-up handshake, so ranks with
different codecs fail at start-up instead of exchanging garbage.

To add a codec (fp8 with a per-row scale, int8 blockwise, ...), implement the four members
of `Codec`; `check_round_trip` tests one against its own wire format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor."""

    shape: tuple[int, ...]
    """The full shape."""
    dtype: torch.dtype
    """The dtype."""

    @staticmethod
    def of(tensor: Tensor) -> TensorSpec:
        """The spec of `tensor`."""
        return TensorSpec(tuple(tensor.shape), tensor.dtype)

    def __str__(self) -> str:
        return f"{self.shape} {str(self.dtype).replace('torch.', '')}"


@runtime_checkable
class Codec(Protocol):
    """Encodes one floating tensor into payload tensors for the wire, and decodes them back."""

    @property
    def name(self) -> str:
        """Identifies the codec and its parameters (e.g. "int8-block256"); equal on every rank."""

    def wire_format(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        """The payloads' specs for a tensor of `spec` (a pure function of `spec`)."""

    def encode(self, tensor: Tensor) -> list[Tensor]:
        """The payloads of `tensor`, matching `wire_format(TensorSpec.of(tensor))`, on its device."""

    def decode(self, payloads: Sequence[Tensor], spec: TensorSpec) -> Tensor:
        """The tensor of `spec` rebuilt from the received `payloads`."""


class IdentityCodec:
    """Sends the tensor as it is (one payload, the tensor itself)."""

    @property
    def name(self) -> str:
        """"identity"."""
        return "identity"

    @property
    def sends_as_is(self) -> bool:
        """True: the stage sends skip it (`sends_as_is`)."""
        return True

    def wire_format(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        """The tensor's own spec."""
        return (spec,)

    def encode(self, tensor: Tensor) -> list[Tensor]:
        """[tensor]."""
        return [tensor]

    def decode(self, payloads: Sequence[Tensor], spec: TensorSpec) -> Tensor:
        """The one payload."""
        return payloads[0]


def sends_as_is(codec: Codec | None) -> bool:
    """Whether `codec` sends every tensor as it is, so the stage sends may skip it: None, or a codec whose
    `sends_as_is` property says so (IdentityCodec; a codec without that property does not)."""
    return codec is None or bool(getattr(codec, "sends_as_is", False))


class CastCodec:
    """Sends the tensor cast to `wire_dtype` (e.g. bfloat16: half the bytes of float32) and casts it
    back on arrival. Lossy: each element keeps wire_dtype's precision (bfloat16: 8 significant bits,
    a relative rounding error of at most 2**-8)."""

    def __init__(self, wire_dtype: torch.dtype = torch.bfloat16) -> None:
        if not isinstance(wire_dtype, torch.dtype) or not wire_dtype.is_floating_point:
            raise ValueError(f"CastCodec needs a floating wire dtype, got {wire_dtype!r}")
        self.wire_dtype = wire_dtype

    @property
    def name(self) -> str:
        """"cast-<dtype>", e.g. "cast-bfloat16"."""
        return f"cast-{str(self.wire_dtype).replace('torch.', '')}"

    def wire_format(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        """One payload of the same shape in the wire dtype."""
        return (TensorSpec(spec.shape, self.wire_dtype),)

    def encode(self, tensor: Tensor) -> list[Tensor]:
        """[tensor in the wire dtype]."""
        return [tensor.to(self.wire_dtype)]

    def decode(self, payloads: Sequence[Tensor], spec: TensorSpec) -> Tensor:
        """The payload cast back to the tensor's dtype."""
        return payloads[0].to(spec.dtype)


def bf16_codec() -> CastCodec:
    """The bfloat16 cast codec."""
    return CastCodec(torch.bfloat16)


def check_codec(codec: object, what: str) -> Codec | None:
    """`codec` if it implements Codec (None stays None); ValueError naming `what` otherwise."""
    if codec is None:
        return None
    if not isinstance(codec, Codec) or not isinstance(codec.name, str) or not codec.name:
        raise ValueError(f"{what} must implement duplexpipe.comm.codec.Codec (name, wire_format, encode, "
                         f"decode), got {codec!r}")
    return codec


def codec_name(codec: Codec | None) -> str:
    """The codec's name; "identity" for None."""
    return "identity" if codec is None else codec.name


def check_round_trip(codec: Codec, tensor: Tensor) -> Tensor:
    """Encode then decode `tensor`, checking the payloads against the codec's wire format and the
    result against the tensor's spec; returns the decoded tensor (ValueError on a mismatch)."""
    spec = TensorSpec.of(tensor)
    payloads = codec.encode(tensor)
    want = codec.wire_format(spec)
    got = tuple(TensorSpec.of(p) for p in payloads)
    if got != want:
        raise ValueError(f"codec {codec.name!r} encoded {spec} into {[str(g) for g in got]} but its wire "
                         f"format says {[str(w) for w in want]}")
    back = codec.decode(payloads, spec)
    if TensorSpec.of(back) != spec:
        raise ValueError(f"codec {codec.name!r} decoded {spec} into {TensorSpec.of(back)}")
    return back
