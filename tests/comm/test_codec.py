"""Transport codecs: the protocol, the identity and cast codecs, and the round-trip check."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from duplexpipe.comm.codec import (
    CastCodec,
    Codec,
    IdentityCodec,
    TensorSpec,
    bf16_codec,
    check_codec,
    check_round_trip,
    codec_name,
)


def test_tensor_spec_describes_shape_and_dtype() -> None:
    spec = TensorSpec.of(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert spec == TensorSpec((2, 3), torch.bfloat16) and str(spec) == "(2, 3) bfloat16"


def test_identity_round_trip_is_the_tensor_itself() -> None:
    x = torch.randn(4, 5)
    codec = IdentityCodec()
    assert isinstance(codec, Codec) and codec.name == "identity"
    assert codec.wire_format(TensorSpec.of(x)) == (TensorSpec.of(x),)
    assert check_round_trip(codec, x) is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bf16_halves_the_bytes_and_keeps_8_significant_bits(dtype: torch.dtype) -> None:
    x = torch.randn(64, 33, dtype=dtype, generator=torch.Generator().manual_seed(0))
    codec = bf16_codec()
    assert codec.name == "cast-bfloat16"
    assert codec.wire_format(TensorSpec.of(x)) == (TensorSpec((64, 33), torch.bfloat16),)
    back = check_round_trip(codec, x)
    assert back.dtype == dtype
    rel = ((back - x).abs() / x.abs().clamp(min=1e-30)).max().item()
    assert 0 < rel <= 2.0 ** -8  # 8 significant bits, round to nearest: unit roundoff 2**-8


class _WrongShape:
    name = "wrong"

    def wire_format(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        return (spec,)

    def encode(self, tensor: Tensor) -> list[Tensor]:
        return [tensor.reshape(-1)]

    def decode(self, payloads: Sequence[Tensor], spec: TensorSpec) -> Tensor:
        return payloads[0].view(spec.shape)


def test_round_trip_check_names_a_codec_that_breaks_its_wire_format() -> None:
    with pytest.raises(ValueError, match=r"codec 'wrong' encoded \(2, 3\) float32 into \['\(6,\) float32'\]"):
        check_round_trip(_WrongShape(), torch.zeros(2, 3))


def test_check_codec_accepts_codecs_and_none_and_names_bad_values() -> None:
    assert check_codec(None, "x") is None and codec_name(None) == "identity"
    codec = CastCodec(torch.float16)
    assert check_codec(codec, "x") is codec and codec_name(codec) == "cast-float16"
    with pytest.raises(ValueError, match="RuntimeConfig.activation_codec must implement"):
        check_codec("bf16", "RuntimeConfig.activation_codec")
    with pytest.raises(ValueError, match="floating wire dtype"):
        CastCodec(torch.int8)
