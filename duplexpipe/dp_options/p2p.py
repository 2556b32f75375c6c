"""Stage-to-stage send compression as the trainer accepts it, torch-free: the codec names and their options, the
grammar of `PrecisionConfig.p2p_compression`, and what a non-finite send does (`comm.p2p_codecs` builds the codecs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Union

from duplexpipe.dp_options.compression import AdaptiveOptions
from duplexpipe.dp_options.labels import Label, build_options, parse_label, parse_labels

P2P_COMPRESSION = ("bf16", "fp8", "int8")
"""The names `p2p_compression` knows (None: no compression)."""
FP8_FORMAT_NAMES = ("e4m3", "e5m2")
"""The float8 formats of the fp8 codec (`comm.quantize.FP8_FORMATS` holds their dtypes)."""
CODEC_OPTIONS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"bf16": (), "fp8": ("fmt",), "int8": ("block", "stochastic_seed")})
"""The options each name takes in its label form ("int8(block=128)", "fp8(fmt='e5m2')")."""
NONFINITE_POLICIES = ("warn", "raise")
"""What happens when a tensor sent through a codec holds NaN or inf (`comm.nonfinite`)."""


@dataclass(frozen=True)
class Given:
    """An object `p2p_compression` holds for a direction (a Codec; `comm.p2p_codecs` checks it) and where it
    stood: `pair_item` for an item of an (activation, gradient) pair, else the whole setting."""

    value: Any
    what: str
    pair_item: bool


Direction = Union[Label, Given, None]
"""One direction of a `p2p_compression`: None (as computed), a checked label (name, options) or an object given."""


def check_policy(policy: object, what: str) -> str:
    """`policy` if it is one of NONFINITE_POLICIES; ValueError naming `what` otherwise."""
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"{what} must be one of {list(NONFINITE_POLICIES)}, got {policy!r}")
    return str(policy)


def check_fp8_format(fmt: object) -> str:
    """`fmt` if it is one of FP8_FORMAT_NAMES; ValueError naming it otherwise."""
    if fmt not in FP8_FORMAT_NAMES:
        raise ValueError(f"unknown fp8 format {fmt!r}; expected one of {sorted(FP8_FORMAT_NAMES)}")
    return str(fmt)


def check_int8_codec(block: object, stochastic_seed: object) -> None:
    """ValueError naming the value unless `block` is an int >= 1 and `stochastic_seed` an int or None."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"Int8BlockCodec block must be an int >= 1, got {block!r}")
    if stochastic_seed is not None and (isinstance(stochastic_seed, bool) or not isinstance(stochastic_seed, int)):
        raise ValueError(f"Int8BlockCodec stochastic_seed must be an int or None, got {stochastic_seed!r}")


def codec_labels(name: str, options: dict[str, Any], text: str) -> tuple[Label, Label]:
    """The checked (activation, gradient) labels of one parsed label: "fp8" alone is e4m3 activations and e5m2
    gradients, any other name (with its options) the same both ways."""
    if name == "fp8" and not options:
        return ("fp8", {"fmt": "e4m3"}), ("fp8", {"fmt": "e5m2"})
    if name not in CODEC_OPTIONS:
        raise ValueError(f"unknown p2p_compression {text!r}; expected None, one of {list(P2P_COMPRESSION)} (with "
                         "options as in 'int8(block=128)'), a Codec, or an (activation, gradient) pair of those "
                         "('fp8, none')")
    if set(options) - set(CODEC_OPTIONS[name]):
        takes = ", ".join(CODEC_OPTIONS[name]) or "no options"
        raise ValueError(f"p2p_compression {text!r}: unknown option(s) {sorted(options)}; {name} takes {takes}")
    if name == "fp8":
        check_fp8_format(options.get("fmt", "e4m3"))
    if name == "int8":
        check_int8_codec(options.get("block", 256), options.get("stochastic_seed"))
    return (name, options), (name, options)


def named_labels(name: str) -> tuple[Label, Label]:
    """`codec_labels` of a compression name written as text ("int8(block=128, stochastic_seed=0)")."""
    label, options = parse_label(name)
    return codec_labels(label, options, name)


def ladder_labels(options: AdaptiveOptions) -> list[tuple[Label, Label] | None]:
    """Each rung of an adaptive ladder as its (activation, gradient) labels (None: "none"); ValueError naming a rung
    that is not a stage-send compression."""
    rungs: list[tuple[Label, Label] | None] = []
    for label in options.rung_labels:
        try:
            rungs.append(None if label == "none" else named_labels(label))
        except ValueError as exc:
            raise ValueError(f"adaptive p2p_compression ladder rung {label!r}: {exc}") from None
    return rungs


def _one(value: Any, slot: int, what: str) -> Direction:
    if value is None or value == "none":
        return None
    if isinstance(value, str):
        return named_labels(value)[slot]
    return Given(value, what, pair_item=True)


def p2p_labels(spec: Any, what: str = "p2p_compression") -> AdaptiveOptions | tuple[Direction, Direction]:
    """`spec` read as (activation, gradient) directions: None or "none" (no compression), a name of P2P_COMPRESSION
    (with options as in "int8(block=128)"), an object (a Codec, both directions), or an (activation, gradient) pair
    whose items are None, a name or an object; as text a pair is "fp8, none"; or "adaptive(ladder=none/bf16/int8,
    ...)" (an AdaptiveOptions, its rungs checked). ValueError naming `what`, the value and the choices; an object is
    passed on as `Given`, for `comm.p2p_codecs` to check."""
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise ValueError(f"{what} as a pair must be (activation, gradient), got {len(spec)} items: {spec!r}")
        return _one(spec[0], 0, f"{what}[0] (activations)"), _one(spec[1], 1, f"{what}[1] (gradients)")
    if spec is None or spec == "none":
        return None, None
    if isinstance(spec, AdaptiveOptions):
        ladder_labels(spec)
        return spec
    if isinstance(spec, str):  # a name, a name with options, or "activation, gradient" as text
        labels = parse_labels(spec)
        if len(labels) == 1 and labels[0][0] == "adaptive":
            options = build_options(AdaptiveOptions, labels[0][1], f"{what} {spec!r}")
            ladder_labels(options)
            return options  # type: ignore[no-any-return]
        if len(labels) > 2:
            raise ValueError(f"{what} as a pair must be 'activation, gradient', got {len(labels)} items: {spec!r}")
        if len(labels) == 1:
            return codec_labels(*labels[0], spec)
        first, second = (None if (n, o) == ("none", {}) else codec_labels(n, o, spec)[k]
                         for k, (n, o) in enumerate(labels))
        return first, second
    return Given(spec, what, pair_item=False), Given(spec, what, pair_item=False)


def holds_objects(directions: AdaptiveOptions | tuple[Direction, Direction]) -> bool:
    """Whether `p2p_labels`' answer holds an object given (a Codec to check with `comm.p2p_codecs`)."""
    return isinstance(directions, tuple) and any(isinstance(d, Given) for d in directions)
