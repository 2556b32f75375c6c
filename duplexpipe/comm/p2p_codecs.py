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
from duplexpipe.dp_options.labels import build_options, parse_label, parse_labels

P2P_COMPRESSION = ("bf16", "fp8", "int8")
"""The names `p2p_codec_pair` knows (None: no compression)."""


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
        if fmt not in FP8_FORMATS:
            raise ValueError(f"unknown fp8 format {fmt!r}; expected one of {sorted(FP8_FORMATS)}")
        self.fmt = fmt

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
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"Int8BlockCodec block must be an int >= 1, got {block!r}")
        if stochastic_seed is not None and (isinstance(stochastic_seed, bool) or not isinstance(stochastic_seed, int)):
            raise ValueError(f"Int8BlockCodec stochastic_seed must be an int or None, got {stochastic_seed!r}")
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
"""Each name's codec from its options (the label form "int8(block=128)", "fp8(fmt='e5m2')")."""
_CODEC_KEYS = {"bf16": "no options", "fp8": "fmt", "int8": "block, stochastic_seed"}


def _labelled(name: str, options: dict[str, Any], text: str) -> tuple[Codec, Codec]:
    """The (activation, gradient) codecs of one parsed label."""
    if name == "fp8" and not options:
        return Fp8RowCodec("e4m3"), Fp8RowCodec("e5m2")
    if name not in _CODECS:
        raise ValueError(f"unknown p2p_compression {text!r}; expected None, one of {list(P2P_COMPRESSION)} (with "
                         "options as in 'int8(block=128)'), a Codec, or an (activation, gradient) pair of those "
                         "('fp8, none')")
    try:
        codec = _CODECS[name](**options)
    except TypeError:
        raise ValueError(f"p2p_compression {text!r}: unknown option(s) {sorted(options)}; {name} takes "
                         f"{_CODEC_KEYS[name]}") from None
    return codec, codec


def named_codecs(name: str) -> tuple[Codec, Codec]:
    """(activation codec, gradient codec) of a compression name: "bf16" -> bf16/bf16, "fp8" -> e4m3/e5m2
    (gradients need e5m2's range more than e4m3's precision), "int8" -> int8 blocks of 256 both ways; a name with
    options ("int8(block=128, stochastic_seed=0)", "fp8(fmt='e5m2')") gives that codec both ways."""
    label, options = parse_label(name)
    return _labelled(label, options, name)


def _one(value: Any, slot: int, what: str) -> Codec | None:
    if value is None or value == "none":
        return None
    if isinstance(value, str):
        return named_codecs(value)[slot]
    return check_codec(value, what)


def p2p_codec_pair(spec: Any, what: str = "p2p_compression") -> tuple[Codec | None, Codec | None]:
    """(activation codec, gradient codec) for `spec`: None or "none" (no compression), a name of P2P_COMPRESSION
    (with options as in "int8(block=128)"), a Codec (both directions), or an (activation, gradient) pair whose
    items are None, a name (that name's codec for the direction) or a Codec; as text a pair is "fp8, none"; or
    "adaptive(ladder=none/bf16/int8, ...)" (an AdaptiveOptions): each link's codec chosen at run time
    (`comm.adaptive_links`).
    ValueError naming `what`, the value and the choices."""
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise ValueError(f"{what} as a pair must be (activation, gradient), got {len(spec)} items: {spec!r}")
        return _one(spec[0], 0, f"{what}[0] (activations)"), _one(spec[1], 1, f"{what}[1] (gradients)")
    if spec is None or spec == "none":
        return None, None
    if isinstance(spec, AdaptiveOptions):
        return adaptive_pair(spec, named_codecs)
    if isinstance(spec, str):  # a name, a name with options, or "activation, gradient" as text
        labels = parse_labels(spec)
        if len(labels) == 1 and labels[0][0] == "adaptive":
            return adaptive_pair(build_options(AdaptiveOptions, labels[0][1], f"{what} {spec!r}"), named_codecs)
        if len(labels) > 2:
            raise ValueError(f"{what} as a pair must be 'activation, gradient', got {len(labels)} items: {spec!r}")
        codecs = [None if (n, o) == ("none", {}) else _labelled(n, o, spec)[k] for k, (n, o) in enumerate(labels)]
        return (codecs[0], codecs[1]) if len(codecs) == 2 else _labelled(*labels[0], spec)
    if isinstance(spec, Codec):
        codec = check_codec(spec, what)
        return codec, codec
    raise ValueError(f"{what} must be None, one of {list(P2P_COMPRESSION)}, a Codec or an (activation, "
                     f"gradient) pair, got {spec!r}")
