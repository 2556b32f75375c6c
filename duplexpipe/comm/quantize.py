"""Quantizers as plain tensor functions: int8 blockwise (stochastic or nearest rounding) and fp8 per row.

Error bounds (for finite input; `scale` is the block's or row's fp32 scale):
- int8, round to nearest: |x - dequantize(quantize(x))| <= scale / 2, scale = max|block| / 127.
- int8, stochastic: < scale, and the expectation over the generator's draws is x (unbiased).
- fp8: <= 2**-(m+1) * |x| + 2**(e_min - m - 1) * scale with scale = max|row| / fmt_max, where m is the
  format's mantissa bits and e_min its smallest normal exponent (e4m3: m=3, e_min=-6; e5m2: m=2, e_min=-14).
Each bound holds up to one rounding of the product codes * scale in the output dtype.

A block (or row) holding NaN or +-inf gets a NaN scale and zero codes: it dequantizes to NaN and
`~scales.isfinite()` reports it, instead of scaling the rest of the block to garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from duplexpipe.dp_options.p2p import check_fp8_format

INT8_MAX = 127
"""Largest code magnitude; -128 is never used, so codes are symmetric."""


@dataclass(frozen=True)
class Fp8Format:
    """One float8 format: its torch dtype and the constants of its error bound."""

    dtype: torch.dtype
    """torch.float8_e4m3fn or torch.float8_e5m2."""
    max: float
    """Largest finite magnitude."""
    mantissa_bits: int
    """Explicit mantissa bits (relative rounding error 2**-(m+1))."""
    min_normal_exp: int
    """Exponent of the smallest normal number (subnormal spacing 2**(e_min - m))."""


FP8_FORMATS = {
    "e4m3": Fp8Format(torch.float8_e4m3fn, 448.0, 3, -6),
    "e5m2": Fp8Format(torch.float8_e5m2, 57344.0, 2, -14),
}


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype for a tensor of `dtype`: float64 stays float64, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocks(x: Tensor, block: int) -> Tensor:
    """x flattened and zero-padded to a multiple of `block`, as (blocks, block) in its working dtype."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    flat = x.reshape(-1).to(work_dtype(x.dtype))
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def _scales(rows: Tensor, top: float) -> tuple[Tensor, Tensor]:
    """(fp32 scale per row with scale * top >= max|row|, mask of rows holding NaN or inf)."""
    amax = rows.abs().amax(dim=1)  # NaN or inf here exactly when the row holds one
    bad = ~amax.isfinite()
    amax = amax.masked_fill(bad, 0.0)
    scale = (amax / top).float()
    low = scale.double() * top < amax.double()  # fp32 rounding went down: step up one ulp (exact check)
    scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    return scale.masked_fill(bad, float("nan")), bad


def _divide(rows: Tensor, scale: Tensor, bad: Tensor) -> Tensor:
    """rows / scale per row, as a new tensor (rows of scale 0 stay 0; NaN rows become 0)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(rows.dtype).unsqueeze(1)
    y = torch.div(rows, safe)
    if bool(bad.any()):
        y.masked_fill_(bad.unsqueeze(1), 0.0)
    return y


def quantize_int8(x: Tensor, block: int = 256, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """(int8 codes shaped like x.reshape(-1), fp32 scale per block of `block` consecutive elements).

    Rounds stochastically with uniform draws from `generator` (unbiased), or to nearest when it is None.
    """
    rows = _blocks(x, block)
    scale, bad = _scales(rows, INT8_MAX)
    y = _divide(rows, scale, bad)
    if generator is None:
        y.round_()
    else:
        y.add_(torch.rand(y.shape, generator=generator, dtype=y.dtype, device=y.device)).floor_()
    return y.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).reshape(-1)[: x.numel()], scale


def dequantize_int8(codes: Tensor, scales: Tensor, block: int = 256, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes * scale of their block, flat, in `dtype` (NaN where the scale is NaN)."""
    numel = codes.numel()
    if scales.numel() * block < numel or scales.numel() * block >= numel + block:
        raise ValueError(f"{scales.numel()} scales do not fit {numel} codes in blocks of {block}")
    rows = _blocks(codes, block).to(dtype)
    return (rows * scales.to(dtype).unsqueeze(1)).reshape(-1)[:numel]


def _rows(x: Tensor) -> Tensor:
    """x as (rows, last dimension); a 0-d tensor is one row of one element."""
    return x.reshape(1, 1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])


def quantize_fp8(x: Tensor, fmt: str = "e4m3") -> tuple[Tensor, Tensor]:
    """(float8 payload shaped like x, fp32 scale per row of the last dimension)."""
    spec = _format(fmt)
    rows = _rows(x).to(work_dtype(x.dtype))
    scale, bad = _scales(rows, spec.max)
    y = _divide(rows, scale, bad).clamp_(-spec.max, spec.max)
    return y.to(spec.dtype).reshape(x.shape), scale


def dequantize_fp8(payload: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """payload * its row's scale, shaped like payload, in `dtype`."""
    rows = _rows(payload)
    if scales.numel() != rows.shape[0]:
        raise ValueError(f"{scales.numel()} scales for {rows.shape[0]} rows of a {tuple(payload.shape)} payload")
    return (rows.to(dtype) * scales.to(dtype).unsqueeze(1)).reshape(payload.shape)


def fp8_to_wire(payload: Tensor) -> Tensor:
    """The payload's bytes as uint8 (collectives other than send/recv reject float8 on gloo)."""
    return payload.view(torch.uint8)


def fp8_from_wire(raw: Tensor, fmt: str = "e4m3") -> Tensor:
    """Undo fp8_to_wire: the uint8 bytes viewed as the format's float8 dtype."""
    if raw.dtype != torch.uint8:
        raise ValueError(f"expected a uint8 tensor, got {raw.dtype}")
    return raw.view(_format(fmt).dtype)


def _format(fmt: str) -> Fp8Format:
    return FP8_FORMATS[check_fp8_format(fmt)]
