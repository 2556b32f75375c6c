"""Tests for duplexpipe.comm.quantize: int8 and fp8 error bounds, unbiased stochastic rounding, NaN/inf."""

from __future__ import annotations

import math

import pytest
import torch

from duplexpipe.comm.quantize import (
    FP8_FORMATS,
    INT8_MAX,
    dequantize_fp8,
    dequantize_int8,
    fp8_from_wire,
    fp8_to_wire,
    quantize_fp8,
    quantize_int8,
)


def _data(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values over many magnitudes, so blocks have very different scales."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.pow(10.0, torch.randint(-6, 4, (n,), generator=gen).double())
    return (torch.randn(n, generator=gen, dtype=torch.float64) * mags).to(dtype)


def _block_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-x.numel()) % block
    rows = torch.cat([x.double(), x.new_zeros(pad).double()]).view(-1, block)
    return rows.abs().amax(1) / INT8_MAX


@pytest.mark.parametrize("block", [1, 7, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_int8_round_to_nearest_within_half_a_scale(block: int, dtype: torch.dtype) -> None:
    x = _data(1000, 1, dtype)
    codes, scales = quantize_int8(x, block)
    assert codes.dtype == torch.int8 and codes.shape == (1000,) and scales.dtype == torch.float32
    assert scales.numel() == math.ceil(1000 / block)
    assert int(codes.abs().max()) <= INT8_MAX
    assert torch.all(scales.double() * INT8_MAX >= _block_scales(x, block) * INT8_MAX)  # scale never too small
    back = dequantize_int8(codes, scales, block, torch.float64)
    err = (back - x.double()).abs().view(-1)
    bound = torch.repeat_interleave(scales.double(), block)[:1000]
    assert torch.all(err <= bound * (0.5 + 1e-6))
    if block == 1:  # every element is its own block: relative precision whatever its magnitude
        assert torch.all(err <= x.double().abs() / (2 * INT8_MAX) * (1 + 1e-6))


def test_int8_stochastic_within_one_scale_and_unbiased() -> None:
    x = torch.tensor([0.3, -1.7, 0.01, 2.5, -0.123456, 1e-4, 0.0, 127.0])
    block = 4
    draws = 10_000
    gen = torch.Generator().manual_seed(0)
    many = x.repeat(draws)  # the same blocks 10^4 times: 10^4 independent draws of each
    rows = dequantize_int8(*quantize_int8(many, block, gen), block, torch.float64).view(draws, -1)
    scales = torch.repeat_interleave(quantize_int8(x, block)[1].double(), block)  # the fp32 scales used
    assert torch.all((rows - x.double()).abs() <= scales * (1 + 1e-6))
    # Bernoulli between the two neighbouring codes: sigma = scale * sqrt(p (1 - p))
    frac = x.double() / scales.clamp_min(1e-30)
    p = frac - torch.floor(frac)
    sigma = scales * torch.sqrt(p * (1 - p))
    mean_err = (rows.mean(0) - x.double()).abs()
    assert torch.all(mean_err <= 4 * sigma / math.sqrt(draws) + 1e-12), (mean_err, sigma)
    assert torch.all(sigma[:6] > 0)  # the check is not vacuous: these draws really vary
    # a fixed generator seed reproduces the codes
    a = quantize_int8(x, block, torch.Generator().manual_seed(5))
    b = quantize_int8(x, block, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0])


def test_int8_nonfinite_block_is_reported_not_scaled() -> None:
    x = torch.arange(12, dtype=torch.float32)
    x[5] = float("inf")
    x[9] = float("nan")
    codes, scales = quantize_int8(x, 4)
    assert scales[0].item() == 3.0 / INT8_MAX or abs(scales[0].item() * INT8_MAX - 3.0) < 1e-6
    assert torch.isnan(scales[1]) and torch.isnan(scales[2])
    assert torch.equal(~scales.isfinite(), torch.tensor([False, True, True]))
    back = dequantize_int8(codes, scales, 4)
    assert torch.isfinite(back[:4]).all() and torch.isnan(back[4:]).all()
    assert torch.equal(codes[4:], torch.zeros(8, dtype=torch.int8))


def test_int8_zero_block_and_bad_arguments() -> None:
    codes, scales = quantize_int8(torch.zeros(5), 2)
    assert torch.equal(scales, torch.zeros(3)) and torch.equal(dequantize_int8(codes, scales, 2), torch.zeros(5))
    with pytest.raises(ValueError, match="block must be >= 1, got 0"):
        quantize_int8(torch.ones(3), 0)
    with pytest.raises(ValueError, match="2 scales do not fit 9 codes in blocks of 4"):
        dequantize_int8(torch.zeros(9, dtype=torch.int8), torch.ones(2), 4)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_per_row_within_bound_and_wire_roundtrip(fmt: str) -> None:
    spec = FP8_FORMATS[fmt]
    x = _data(24 * 40, 2).view(24, 40)
    x[3] = 0.0
    payload, scales = quantize_fp8(x, fmt)
    assert payload.dtype == spec.dtype and payload.shape == x.shape and scales.shape == (24,)
    back = dequantize_fp8(payload, scales, torch.float64)
    rel = 2.0 ** -(spec.mantissa_bits + 1)
    sub = 2.0 ** (spec.min_normal_exp - spec.mantissa_bits - 1)
    bound = rel * x.double().abs() + sub * scales.double().unsqueeze(1)
    assert torch.all((back - x.double()).abs() <= bound * (1 + 1e-6))
    assert torch.equal(back[3], torch.zeros(40, dtype=torch.float64))
    wire = fp8_to_wire(payload)
    assert wire.dtype == torch.uint8 and wire.shape == x.shape
    assert torch.equal(fp8_from_wire(wire, fmt).view(torch.uint8), wire)
    assert torch.equal(dequantize_fp8(fp8_from_wire(wire.clone(), fmt), scales, torch.float64), back)


def test_fp8_rows_are_the_last_dimension_and_nonfinite_rows_reported() -> None:
    x = torch.ones(2, 3, 4)
    x[1, 2, 0] = float("nan")
    payload, scales = quantize_fp8(x, "e4m3")
    assert scales.shape == (6,) and torch.equal(~scales.isfinite(), torch.tensor([0, 0, 0, 0, 0, 1]).bool())
    back = dequantize_fp8(payload, scales)
    assert torch.equal(back[0], torch.ones(3, 4)) and torch.isnan(back[1, 2]).all()
    scalar_payload, scalar_scale = quantize_fp8(torch.tensor(-3.0), "e5m2")
    assert dequantize_fp8(scalar_payload, scalar_scale).item() == -3.0


def test_fp8_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="unknown fp8 format 'e3m4'"):
        quantize_fp8(torch.ones(2), "e3m4")
    with pytest.raises(ValueError, match="expected a uint8 tensor, got torch.int8"):
        fp8_from_wire(torch.zeros(2, dtype=torch.int8))
    with pytest.raises(ValueError, match="3 scales for 2 rows"):
        dequantize_fp8(quantize_fp8(torch.ones(2, 2))[0], torch.ones(3))
