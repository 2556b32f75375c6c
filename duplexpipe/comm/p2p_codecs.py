"""Low-precision codecs for stage-to-stage sends (fp8 with a per-row scale, int8 blockwise) and the name table.

Wire formats (announced per message like any tensor; a pure function of shape and dtype):
- `Fp8RowCodec(fmt)` "fp8-<fmt>-row": the float8 payload as its uint8 view (gloo's send/recv move float8
  bit-exactly, but other paths reject the dtype; uint8 works everywhere), shaped like the tensor, plus one
  fp32 scale per row of the last dimension. Per row, |error| <= 2**-(m+1) |x| + 2**(e_min-m-1) scale
  (e4m3: m=3, e_min=-6; e5m2: m=2, e_min=-14), so the per-row relative error max|err| / max|row| stays
  below 2**-3 for e4m3 and 2**-2 for e5m2 with room to spare.
- `Int8BlockCodec(block)` "int8-block<block>": int8 codes of the flattened tensor plus one fp32 scale per
  block of `block` consecutive elements (the last block zero-padded in the scale's computation only).
  Rounding is to nearest by default: |error| <= scale / 2 per element, and the same tensor always encodes
  to the same bytes. Stochastic rounding (unbiased, error < scale) pays off where many quantized values
  are summed over time (gradient all-reduces with error feedback); a stage's activation or input gradient
  is used once, so nearest rounding halves the worst-case error, keeps runs reproducible and needs no
  random state to seed, checkpoint or keep in step across ranks. `stochastic_seed` turns it on.

Non-finite input: a row or block holding NaN or inf gets a NaN scale (comm.quantize) and decodes to NaN,
never to finite garbage, so fp16's overflow check still sees it; `nonfinite(payloads)` counts such rows
or blocks without a device sync (duplexpipe.comm.nonfinite reports them). Finite input decodes finite:
a scale whose largest code would overflow the tensor's dtype (a row holding `finfo.min`) is capped.

`p2p_codec_pair(spec)` maps `PrecisionConfig.p2p_compression` to the (activation, gradient) codecs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from duplexpipe.comm.adaptive_links import adaptive_pair
from duplexpipe.comm.codec import Codec, TensorSpec, bf16_codec, check_codec
from duplexpipe.comm.quantize import (
    FP8_FORMATS,
    INT8_MAX,
    dequantize_fp8,
    dequantize_int8,
    fp8_from_wire,
    fp8_to_wire,
    quantize_fp8,
    quantize_int8,
    work_dtype,
)
from duplexpipe.dp_options.compression import AdaptiveOptions
from duplexpipe.dp_options.p2p import (
    P2P_COMPRESSION,
    Direction,
    Given,
    check_fp8_format,
    check_int8_codec,
    ladder_labels,
    named_labels,
    p2p_labels,
)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def row_count(shape: tuple[int, ...]) -> int:
    """Rows of the last dimension of a tensor of `shape`: 1 for a 0-d tensor, 0 for an empty one."""
    numel = _numel(shape)
    if not shape:
        return 1
    return numel // shape[-1] if numel else 0


def _capped(scales: Tensor, top: float, dtype: torch.dtype) -> Tensor:
    """`scales` capped so that top * scale stays finite in the decoding arithmetic of `dtype` (fp32 unless
    float64, whose products of fp32 scales cannot overflow); NaN and inf scales (non-finite input) stay."""
    if work_dtype(dtype) == torch.float64:
        return scales
    limit = torch.finfo(torch.float32).max / top * (1 - 2.0**-20)
    return scales.masked_fill((scales > limit) & scales.isfinite(), limit)


def _scale_nonfinite(scales: Tensor) -> Tensor:
    """How many scales are NaN or inf, as a 0-d int64 tensor on their device (no sync)."""
    return (~scales.isfinite()).sum()


class Fp8RowCodec:
    """float8 (e4m3 or e5m2) with an fp32 scale per row of the last dimension; the payload travels as uint8."""

    def __init__(self, fmt: str = "e4m3") -> None:
        self.fmt = check_fp8_format(fmt)

    @property
    def name(self) -> str:
        """"fp8-e4m3-row" or "fp8-e5m2-row"."""
        return f"fp8-{self.fmt}-row"

    def wire_format(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        """(uint8 shaped like the tensor, fp32 scales (rows,))."""
        return (TensorSpec(spec.shape, torch.uint8), TensorSpec((row_count(spec.shape),), torch.float32))

    def encode(self, tensor: Tensor) -> list[Tensor]:
        """[float8 payload as uint8, fp32 scale per row]."""
        if tensor.numel() == 0:
            return [torch.empty(tensor.shape, dtype=torch.uint8, device=tensor.device),
                    torch.empty((0,), dtype=torch.float32, device=tensor.device)]
        payload, scales = quantize_fp8(tensor, self.fmt)
        return [fp8_to_wire(payload), scales]

    def decode(self, payloads: Sequence[Tensor], spec: TensorSpec) -> Tensor:
        """payload x its row's scale, in the tensor's dtype (NaN rows where the scale is NaN)."""
        raw, scales = payloads
        if _numel(spec.shape) == 0:
            return torch.empty(spec.shape, dtype=spec.dtype, device=raw.device)
        top = FP8_FORMATS[self.fmt].max
        values = dequantize_fp8(fp8_from_wire(raw, self.fmt), _capped(scales, top, spec.dtype),
                                dtype=work_dtype(spec.dtype))
        return values.to(spec.dtype)

    def nonfinite(self, payloads: Sequence[Tensor]) -> Tensor:
        """Rows that held NaN or inf (a 0-d tensor; no sync)."""
        return _scale_nonfinite(payloads[1])

    def __repr__(self) -> str:
        return f"Fp8RowCodec({self.fmt!r})"


class Int8BlockCodec:
    """int8 codes with an fp32 scale per block of `block` consecutive elements (round to nearest by default)."""

    def __init__(self, block: int = 256, stochastic_seed: int | None = None) -> None:
        check_int8_codec(block, stochastic_seed)
        self.block = block
        self.stochastic_seed = stochastic_seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    def name(self) -> str:
        """"int8-block256"; "int8-block256-sr<seed>" with stochastic rounding."""
        sr = "" if self.stochastic_seed is None else f"-sr{self.stochastic_seed}"
        return f"int8-block{self.block}{sr}"

    def wire_format(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        """(int8 codes (numel,), fp32 scales (ceil(numel / block),))."""
        numel = _numel(spec.shape)
        return (TensorSpec((numel,), torch.int8), TensorSpec((-(-numel // self.block),), torch.float32))

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.stochastic_seed is None:
            return None
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.stochastic_seed)
        return self._generators[device]

    def encode(self, tensor: Tensor) -> list[Tensor]:
        """[int8 codes, fp32 scale per block]."""
        codes, scales = quantize_int8(tensor, self.block, self._generator(tensor.device))
        return [codes, scales]

    def decode(self, payloads: Sequence[Tensor], spec: TensorSpec) -> Tensor:
        """codes x their block's scale, shaped and typed like the tensor (NaN blocks where the scale is NaN)."""
        codes, scales = payloads
        flat = dequantize_int8(codes, _capped(scales, INT8_MAX, spec.dtype), self.block, dtype=work_dtype(spec.dtype))
        return flat.reshape(spec.shape).to(spec.dtype)

    def nonfinite(self, payloads: Sequence[Tensor]) -> Tensor:
        """Blocks that held NaN or inf (a 0-d tensor; no sync)."""
        return _scale_nonfinite(payloads[1])

    def __repr__(self) -> str:
        sr = "" if self.stochastic_seed is None else f", stochastic_seed={self.stochastic_seed}"
        return f"Int8BlockCodec({self.block}{sr})"


_CODECS: dict[str, Any] = {"bf16": lambda: bf16_codec(), "fp8": lambda fmt="e4m3": Fp8RowCodec(fmt),
                           "int8": lambda block=256, stochastic_seed=None: Int8BlockCodec(block, stochastic_seed)}
"""Each name's codec from its checked options (`dp_options.p2p.codec_labels`)."""


def _built(direction: Direction) -> Codec | None:
    """The codec of one direction `p2p_labels` read: None, a label's codec, or the object given, checked."""
    if direction is None:
        return None
    if isinstance(direction, Given):
        if direction.pair_item or isinstance(direction.value, Codec):
            return check_codec(direction.value, direction.what)
        raise ValueError(f"{direction.what} must be None, one of {list(P2P_COMPRESSION)}, a Codec or an (activation, "
                         f"gradient) pair, got {direction.value!r}")
    name, options = direction
    return _CODECS[name](**options)  # type: ignore[no-any-return]


def named_codecs(name: str) -> tuple[Codec, Codec]:
    """(activation codec, gradient codec) of a compression name: "bf16" -> bf16/bf16, "fp8" -> e4m3/e5m2
    (gradients need e5m2's range more than e4m3's precision), "int8" -> int8 blocks of 256 both ways; a name with
    options ("int8(block=128, stochastic_seed=0)", "fp8(fmt='e5m2')") gives that codec both ways."""
    activation, gradient = named_labels(name)
    return _CODECS[activation[0]](**activation[1]), _CODECS[gradient[0]](**gradient[1])


def p2p_codec_pair(spec: Any, what: str = "p2p_compression") -> tuple[Codec | None, Codec | None]:
    """(activation codec, gradient codec) for `spec`: None or "none" (no compression), a name of P2P_COMPRESSION
    (with options as in "int8(block=128)"), a Codec (both directions), or an (activation, gradient) pair whose
    items are None, a name (that name's codec for the direction) or a Codec; as text a pair is "fp8, none"; or
    "adaptive(ladder=none/bf16/int8, ...)" (an AdaptiveOptions): each link's codec chosen at run time
    (`comm.adaptive_links`). The grammar and its checks are torch-free (`dp_options.p2p.p2p_labels`).
    ValueError naming `what`, the value and the choices."""
    directions = p2p_labels(spec, what)
    if isinstance(directions, AdaptiveOptions):
        rungs = [(None, None) if labels is None else (_built(labels[0]), _built(labels[1]))
                 for labels in ladder_labels(directions)]
        return adaptive_pair(directions, rungs)
    return _built(directions[0]), _built(directions[1])
