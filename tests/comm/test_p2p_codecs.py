"""Low-precision send codecs: wire formats, round-trip error bounds, edge shapes, NaN/inf, the name table."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from duplexpipe.comm.codec import CastCodec, Codec, IdentityCodec, TensorSpec, bf16_codec, check_round_trip
from duplexpipe.comm.p2p_codecs import (
    P2P_COMPRESSION,
    Fp8RowCodec,
    Int8BlockCodec,
    named_codecs,
    p2p_codec_pair,
    row_count,
)

ROW_BOUND = {"e4m3": 2.0**-3, "e5m2": 2.0**-2}
"""The issue's per-row relative error bounds, max|x - decoded| / max|x| per row."""
ROUNDING = {"e4m3": (3, -6), "e5m2": (2, -14)}
"""(mantissa bits m, smallest normal exponent e_min): the per-element bound of comm.quantize."""
SHAPES = [(), (0,), (3, 0), (0, 5), (1,), (7,), (255,), (256,), (257,), (4, 3, 65), (2, 300)]
"""0-d, empty, sizes around a block of 256, rows of several lengths."""


def _data(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> Tensor:
    """Values spread over several orders of magnitude, signs mixed, some exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = x * torch.exp(2 * torch.randn(shape, generator=gen, dtype=torch.float64))
    if x.numel() > 3:
        x.view(-1)[::7] = 0.0
    return x.to(dtype)


def _nbytes(specs: tuple[TensorSpec, ...]) -> int:
    return sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in specs)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_round_trip_keeps_each_row_within_its_bound(fmt: str, shape: tuple[int, ...]) -> None:
    x = _data(shape)
    codec = Fp8RowCodec(fmt)
    assert isinstance(codec, Codec) and codec.name == f"fp8-{fmt}-row"
    rows = 1 if not shape else (x.numel() // shape[-1] if x.numel() else 0)
    assert codec.wire_format(TensorSpec.of(x)) == (TensorSpec(shape, torch.uint8), TensorSpec((rows,), torch.float32))
    back = check_round_trip(codec, x)
    if x.numel() == 0:
        return
    m, e_min = ROUNDING[fmt]
    x2, err = x.reshape(rows, -1).double(), (back - x).reshape(rows, -1).double().abs()
    amax = x2.abs().amax(dim=1, keepdim=True)
    scale = codec.encode(x)[1].double().unsqueeze(1)
    assert bool((err <= ROW_BOUND[fmt] * amax).all())  # the stated bound
    elementwise = 2.0 ** -(m + 1) * x2.abs() + 2.0 ** (e_min - m - 1) * scale
    assert bool((err <= elementwise * (1 + 2**-20)).all())  # the quantizer's own, much tighter bound
    assert bool((back[x == 0] == 0).all())  # zeros stay exact


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [1, 16, 256])
def test_int8_round_trip_is_within_half_a_step_of_its_block(shape: tuple[int, ...], block: int) -> None:
    x = _data(shape, seed=1)
    codec = Int8BlockCodec(block)
    assert codec.name == f"int8-block{block}"
    blocks = -(-x.numel() // block)
    assert codec.wire_format(TensorSpec.of(x)) == (TensorSpec((x.numel(),), torch.int8),
                                                   TensorSpec((blocks,), torch.float32))
    back = check_round_trip(codec, x)
    if x.numel() == 0:
        return
    flat = torch.nn.functional.pad(x.reshape(-1).double(), (0, blocks * block - x.numel())).view(blocks, block)
    step = flat.abs().amax(dim=1) / 127  # the scale of each block
    err = torch.nn.functional.pad((back - x).reshape(-1).double().abs(), (0, blocks * block - x.numel()))
    assert bool((err.view(blocks, block) <= step.unsqueeze(1) / 2 * (1 + 2**-20)).all())
    assert torch.equal(codec.encode(x)[0], codec.encode(x)[0])  # nearest rounding: deterministic


def test_int8_stochastic_rounding_is_seeded_unbiased_and_named() -> None:
    x = torch.full((4096,), 0.3)
    x[0] = 1.0  # scale 1/127: 0.3 sits between two codes
    a, b = Int8BlockCodec(4096, stochastic_seed=5), Int8BlockCodec(4096, stochastic_seed=5)
    assert a.name == "int8-block4096-sr5"
    first, again = check_round_trip(a, x), check_round_trip(b, x)
    assert torch.equal(first, again)  # same seed, same draws
    step = 1.0 / 127
    assert bool(((first - x).abs() < step).all())
    assert abs(first[1:].mean().item() - 0.3) < 0.1 * step  # unbiased: the mean lands on 0.3
    assert len(set(first[1:].tolist())) == 2  # both neighbouring codes occur


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bf16_relative_error_is_at_most_2_to_the_minus_8(dtype: torch.dtype) -> None:
    x = _data((64, 33), dtype)
    back = check_round_trip(bf16_codec(), x)
    nonzero = x != 0
    rel = ((back - x).abs()[nonzero] / x.abs()[nonzero]).max().item()
    assert 0 < rel <= 2.0**-8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("codec", [Fp8RowCodec("e4m3"), Fp8RowCodec("e5m2"), Int8BlockCodec(64)], ids=repr)
def test_other_float_dtypes_round_trip_in_their_own_dtype(codec: Codec, dtype: torch.dtype) -> None:
    x = _data((6, 40), dtype, seed=2)
    back = check_round_trip(codec, x)
    amax = x.double().abs().amax(dim=1, keepdim=True)
    assert bool(((back.double() - x.double()).abs() <= 2.0**-2 * amax).all())


@pytest.mark.parametrize("codec", [Fp8RowCodec("e4m3"), Fp8RowCodec("e5m2"), Int8BlockCodec(4)], ids=repr)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_decodes_non_finite_and_is_counted(codec: Codec, bad: float) -> None:
    x = torch.arange(1.0, 13.0).reshape(3, 4)  # rows of 4 = blocks of 4
    x[1, 2] = bad
    payloads = codec.encode(x)
    back = codec.decode(payloads, TensorSpec.of(x))
    assert bool(back[1].isnan().all())  # the whole row/block holding it: NaN, not finite garbage
    assert torch.equal(back[[0, 2]], check_round_trip(codec, x[[0, 2]]))  # the other rows are untouched
    assert int(codec.nonfinite(payloads)) == 1  # type: ignore[attr-defined]
    assert int(codec.nonfinite(codec.encode(x[[0, 2]]))) == 0  # type: ignore[attr-defined]


def test_wire_bytes_against_fp32() -> None:
    spec = TensorSpec((4, 64, 64), torch.float32)  # the GPT example's message: rows of d_model=64
    fp32 = _nbytes((spec,))
    assert _nbytes(bf16_codec().wire_format(spec)) / fp32 == 0.5
    assert _nbytes(Fp8RowCodec().wire_format(spec)) == 4 * 64 * (64 + 4)  # one byte each + 4 per row
    assert _nbytes(Fp8RowCodec().wire_format(spec)) / fp32 <= 0.27
    assert _nbytes(Int8BlockCodec().wire_format(spec)) == 4 * 64 * 64 + 4 * 64  # one byte each + 4 per 256
    assert _nbytes(Int8BlockCodec().wire_format(spec)) / fp32 <= 0.27


def test_row_count() -> None:
    assert [row_count(s) for s in [(), (0,), (3, 0), (0, 5), (5,), (2, 3, 4)]] == [1, 0, 0, 0, 1, 6]


def test_names_map_to_activation_and_gradient_codecs() -> None:
    assert P2P_COMPRESSION == ("bf16", "fp8", "int8")
    assert [(a.name, g.name) for a, g in map(named_codecs, P2P_COMPRESSION)] == [
        ("cast-bfloat16", "cast-bfloat16"), ("fp8-e4m3-row", "fp8-e5m2-row"), ("int8-block256", "int8-block256")]
    assert p2p_codec_pair(None) == (None, None)
    codec = Int8BlockCodec(32)
    assert p2p_codec_pair(codec) == (codec, codec)
    act, grad = p2p_codec_pair(("fp8", None))
    assert isinstance(act, Fp8RowCodec) and act.fmt == "e4m3" and grad is None
    act, grad = p2p_codec_pair([IdentityCodec(), "fp8"])
    assert isinstance(act, IdentityCodec) and isinstance(grad, Fp8RowCodec) and grad.fmt == "e5m2"
    assert isinstance(p2p_codec_pair((CastCodec(torch.float16), codec))[0], CastCodec)


@pytest.mark.parametrize(("value", "message"), [
    ("fp4", r"unknown p2p_compression 'fp4'; expected None, one of \['bf16', 'fp8', 'int8'\]"),
    ("FP8", r"unknown p2p_compression 'FP8'"),
    (8, r"p2p_compression must be None, one of \['bf16', 'fp8', 'int8'\], a Codec .* got 8"),
    (("fp8",), r"p2p_compression as a pair must be \(activation, gradient\), got 1 items"),
    (("fp8", 3), r"p2p_compression\[1\] \(gradients\) must implement .*Codec.* got 3"),
    (("int4", None), r"unknown p2p_compression 'int4'"),
])
def test_bad_compression_values_name_the_value_and_the_choices(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        p2p_codec_pair(value)


def test_bad_codec_parameters_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown fp8 format 'e3m4'; expected one of \['e4m3', 'e5m2'\]"):
        Fp8RowCodec("e3m4")
    for block in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"block must be an int >= 1, got {block!r}"):
            Int8BlockCodec(block)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stochastic_seed must be an int or None, got 'x'"):
        Int8BlockCodec(256, stochastic_seed="x")  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("codec", [Fp8RowCodec("e4m3"), Fp8RowCodec("e5m2"), Int8BlockCodec(256),
                                   Int8BlockCodec(256, stochastic_seed=1)], ids=repr)
def test_codecs_run_on_cuda_like_on_the_cpu(codec: Codec) -> None:
    x = _data((4, 64, 64))
    x[1, 3, 7] = float("inf")
    on_gpu = check_round_trip(codec, x.cuda())
    assert on_gpu.device.type == "cuda" and all(p.device.type == "cuda" for p in codec.encode(x.cuda()))
    assert bool(on_gpu[1, 3].isnan().any()) and int(codec.nonfinite(codec.encode(x.cuda()))) == 1  # type: ignore[attr-defined]
    keep = torch.ones(4, 64, dtype=torch.bool)
    keep[1, 3] = False  # the row holding inf (an int8 block of 256 is 4 rows of 64 here)
    if isinstance(codec, Int8BlockCodec):
        keep[1] = False
    err = (on_gpu.cpu() - x).abs()[keep]
    assert bool((err <= 2.0**-2 * x.abs()[keep].amax()).all())  # looser than every codec's bound
