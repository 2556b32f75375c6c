"""Gradient compression methods the trainer accepts: their names and option dataclasses, and which of them have
a reduce-scatter form (ZeRO); torch-free, so the planner reads the same table the trainer checks."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, ClassVar, Union

from duplexpipe.dp_options.labels import build_options, parse_label


def _ratio(value: float, what: str = "ratio") -> None:
    if not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
        raise ValueError(f"{what} must be in (0, 1], got {value!r}")


def _seed(value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"seed must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class NoCompression:
    """Plain all-reduce of the full-precision gradients."""

    method: ClassVar[str] = "none"


@dataclass(frozen=True)
class Bf16Options:
    """torch's bf16_compress_hook: cast to bfloat16, all-reduce, cast back (no error feedback)."""

    method: ClassVar[str] = "bf16"


@dataclass(frozen=True)
class Fp16Options:
    """torch's fp16_compress_hook: cast to float16, all-reduce, cast back (no error feedback)."""

    method: ClassVar[str] = "fp16"


@dataclass(frozen=True)
class PowerSGDOptions:
    """torch's powerSGD_hook with PowerSGDState (Vogels et al. 2019): error feedback and warm start on."""

    rank: int = 4
    """Rank of the low-rank approximation of each gradient matrix."""
    start_step: int = 10
    """Optimizer steps reduced exactly before compression starts (torch needs >= 2 with error feedback)."""
    min_compression_rate: float = 2.0
    """A matrix is compressed only if this many times fewer numbers go on the wire (else all-reduced)."""
    warm_start: bool = True
    """Reuse the last step's Q as the power iteration's start."""
    seed: int = 0
    """Seed of the random initial Q (the same on every rank)."""

    method: ClassVar[str] = "powersgd"

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"powersgd rank must be an int >= 1, got {self.rank!r}")
        if not isinstance(self.start_step, int) or self.start_step < 2:
            raise ValueError(f"powersgd start_step must be an int >= 2 (torch's PowerSGD with error feedback "
                             f"needs two exact steps first), got {self.start_step!r}")
        if not self.min_compression_rate > 0:
            raise ValueError(f"min_compression_rate must be > 0, got {self.min_compression_rate!r}")
        _seed(self.seed)


@dataclass(frozen=True)
class Int8Options:
    """Blockwise int8 with stochastic rounding and error feedback; all_to_all -> fp32 sum on the owner of
    each shard -> requantize (with the owner's own error feedback) -> all_gather."""

    block: int = 256
    """Elements per fp32 scale."""
    stochastic: bool = True
    """Stochastic rounding (unbiased); False rounds to nearest."""
    seed: int = 0
    """Seed of the rounding noise (each rank draws from seed and its rank)."""

    method: ClassVar[str] = "int8"

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"int8 block must be an int >= 1, got {self.block!r}")
        _seed(self.seed)


@dataclass(frozen=True)
class TopKOptions:
    """Top-k with error feedback: the k = round(ratio * numel) largest-magnitude entries of each bucket go
    as (value, int32 index) slots, exchanged by one all_gather."""

    ratio: float = 0.01
    """Fraction of each bucket's entries transmitted (the slot count), in (0, 1]."""
    allow_adaptive_optimizer: bool = False
    """Allow an Adam-family optimizer (measured: top-k + error feedback under AdamW lost 8.7% on the GPT)."""

    method: ClassVar[str] = "topk"

    def __post_init__(self) -> None:
        _ratio(self.ratio)


@dataclass(frozen=True)
class RandomKOptions(TopKOptions):
    """Random-k with error feedback: k entries drawn uniformly per bucket, rank and step."""

    seed: int = 0
    """Seed of the index draws (each rank draws from seed and its rank)."""

    method: ClassVar[str] = "randomk"

    def __post_init__(self) -> None:
        super().__post_init__()
        _seed(self.seed)


@dataclass(frozen=True)
class ThresholdOptions(TopKOptions):
    """The seeds' threshold rule, honestly named (it is not DGC): entries with |g| >= theta * max|g|, at
    most k of them, with error feedback. The k slots always go on the wire (static shapes)."""

    theta: float = 0.5
    """Fraction of max|g| an entry must reach, in [0, 1]."""

    method: ClassVar[str] = "threshold"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.theta <= 1.0:
            raise ValueError(f"theta must be in [0, 1], got {self.theta!r}")


@dataclass(frozen=True)
class DGCOptions:
    """Deep Gradient Compression: top-k of the momentum-corrected velocity (over the bucket, or per tensor),
    local clipping, momentum factor masking, warm-up sparsity. Use SGD without momentum of its own: DGC
    applies `momentum`."""

    ratio: float = 0.01
    """Fraction transmitted after warm-up (0.01 = 99% sparsity; 0.001 = 99.9%), in (0, 1]."""
    momentum: float = 0.9
    """Momentum of the momentum correction, in [0, 1)."""
    clip_norm: float | None = None
    """Local gradient clipping, clip_norm being the threshold of the averaged gradient's norm: each rank's
    mean gradient is scaled to norm at most clip_norm * sqrt(DP size) before the momentum (the paper's
    N^(-1/2) of the threshold for a node's 1/N share of the sum; comm.dgc.local_clip_threshold). In a
    Pipeline the norm is over the replica's whole model (all pipeline stages); a reducer used on its own
    clips each bucket by that bucket's norm."""
    selection: str = "bucket"
    """"bucket": the k = round(ratio * numel) largest entries of the whole bucket (one threshold over its
    tensors: the best k-sparse approximation of the velocity). "tensor": each tensor of the bucket keeps
    its own k_i = round(ratio * numel_i), at least 1 (the paper's Algorithm 1 selects layer by layer);
    measured on the GPT example it starves the embeddings and head (docs/benchmarks.md)."""
    warmup_steps: int = 0
    """Steps at each warm-up sparsity (75%, 93.75%, 98.4375%, 99.6%, 99.9%, those below the target); 0: off."""
    allow_adaptive_optimizer: bool = False
    """Allow an Adam-family optimizer (DGC's momentum correction assumes SGD)."""

    method: ClassVar[str] = "dgc"

    def __post_init__(self) -> None:
        _ratio(self.ratio)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"dgc momentum must be in [0, 1), got {self.momentum!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"dgc clip_norm must be > 0 or None, got {self.clip_norm!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"dgc warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.selection not in ("bucket", "tensor"):
            raise ValueError(f"dgc selection must be 'bucket' or 'tensor', got {self.selection!r}")


@dataclass(frozen=True)
class AdaptiveOptions:
    """Compression chosen at run time per bucket (or per stage link) from its measured exposed communication: a
    key moves one rung up the ladder (more compression) after `patience` steps exposed, one rung down after
    `patience` steps hidden (`duplexpipe.comm.adaptive`). Every rank of a group decides alike from the same
    all-reduced measurements."""

    ladder: str = "none/bf16/int8"
    """The rungs, lightest first, separated by "/": method names with options as in "none/bf16/int8/powersgd(rank=2,
    start_step=2)" (gradients: any method but dgc and adaptive; stage sends: "none", "bf16", "fp8", "int8")."""
    start: str | None = None
    """The rung every key starts on (as written in the ladder); None: the lightest. With schedule="auto" the
    planner's choice among the ladder's rungs."""
    patience: int = 3
    """Consecutive steps a key must be exposed (or hidden) before it moves one rung."""
    up: float = 0.02
    """A key is exposed when its exposed time exceeds this fraction of the step's time."""
    down: float = 0.005
    """A key is hidden when its exposed time is at most this fraction of the step's time (below `up`: the band
    between them is hysteresis, where nothing moves)."""
    max_hold: int = 64
    """A key that moved down and came back up within a few steps (a failed probe) waits twice as long before its
    next probe down, up to this many hidden steps."""
    guard: float = 0.05
    """Loss-quality guard: when the loss's moving average rises this fraction above its lowest, the ladder's top
    rung in use is closed (keys on it move one down) for the rest of the run; 0: off."""

    method: ClassVar[str] = "adaptive"

    def __post_init__(self) -> None:
        if not isinstance(self.ladder, str) or len(self.rung_labels) < 2:
            raise ValueError(f"adaptive ladder must name at least two rungs separated by '/', e.g. "
                             f"'none/bf16/int8', got {self.ladder!r}")
        labels = self.rung_labels
        if len(set(labels)) != len(labels):
            raise ValueError(f"adaptive ladder {self.ladder!r} names a rung twice")
        if self.start is not None and self.start not in labels:
            raise ValueError(f"adaptive start {self.start!r} is not a rung of the ladder {labels}")
        if not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"adaptive patience must be an int >= 1, got {self.patience!r}")
        if not (isinstance(self.down, (int, float)) and isinstance(self.up, (int, float)) and 0 <= self.down < self.up):
            raise ValueError(f"adaptive thresholds need 0 <= down < up, got down={self.down!r}, up={self.up!r}")
        if not isinstance(self.max_hold, int) or self.max_hold < self.patience:
            raise ValueError(f"adaptive max_hold must be an int >= patience ({self.patience}), got {self.max_hold!r}")
        if not (isinstance(self.guard, (int, float)) and self.guard >= 0):
            raise ValueError(f"adaptive guard must be >= 0 (0: off), got {self.guard!r}")

    @cached_property
    def rung_labels(self) -> tuple[str, ...]:
        """The ladder's rungs as written, lightest first (parsed once: the controller reads them every step)."""
        return tuple(part.strip() for part in self.ladder.split("/") if part.strip())

    @property
    def start_rung(self) -> int:
        """The index of the starting rung."""
        return 0 if self.start is None else self.rung_labels.index(self.start)

    def gradient_rungs(self) -> tuple[Options, ...]:
        """The ladder as gradient-compression options; ValueError for a rung that cannot be one."""
        rungs = tuple(compression_options(label) for label in self.rung_labels)
        for label, rung in zip(self.rung_labels, rungs, strict=True):
            if isinstance(rung, (AdaptiveOptions, DGCOptions)):
                raise ValueError(f"adaptive ladder rung {label!r}: {rung.method!r} cannot be a rung (DGC's momentum "
                                 "correction and a nested adaptive keep no residual another rung can take over)")
        return rungs


Options = Union[NoCompression, Bf16Options, Fp16Options, PowerSGDOptions, Int8Options, TopKOptions, RandomKOptions,
                ThresholdOptions, DGCOptions, AdaptiveOptions]
"""Any method's options."""

_BY_NAME: dict[str, Any] = {
    "none": NoCompression,
    "bf16": Bf16Options,
    "fp16": Fp16Options,
    "powersgd": PowerSGDOptions,
    "int8": Int8Options,
    "topk": TopKOptions,
    "randomk": RandomKOptions,
    "threshold": ThresholdOptions,
    "dgc": DGCOptions,
    "adaptive": AdaptiveOptions,
}
METHOD_NAMES = tuple(_BY_NAME)
"""The names compression_options() accepts."""
_OPTION_TYPES = (NoCompression, Bf16Options, Fp16Options, PowerSGDOptions, Int8Options, TopKOptions, DGCOptions,
                 AdaptiveOptions)


def compression_options(spec: str | Options | None) -> Options:
    """Options from a method name (defaults) or its label with options ("powersgd(rank=1)", "dgc(ratio=0.001)": the
    text form `options_label` writes), an options object (returned as is), or None (no compression)."""
    if spec is None:
        return NoCompression()
    if isinstance(spec, _OPTION_TYPES):
        if isinstance(spec, AdaptiveOptions):
            spec.gradient_rungs()
        return spec
    if isinstance(spec, str):
        name, options = parse_label(spec) if "(" in spec else (spec, {})
        name = name.lower()  # method names are case-insensitive here (p2p codec names are not)
        if name in _BY_NAME:
            built = build_options(_BY_NAME[name], options, f"gradient compression {spec!r}")
            if isinstance(built, AdaptiveOptions):
                built.gradient_rungs()
            return built  # type: ignore[no-any-return]
    raise ValueError(f"unknown gradient compression {spec!r}; expected one of {METHOD_NAMES} (with options as in "
                     "'powersgd(rank=1)') or an options object")


SHARDED_METHODS = ("none", "bf16", "fp16", "int8")
"""Gradient compression methods that have a reduce-scatter form (the others have none: see check_sharded)."""
GradientWire = Union[NoCompression, Bf16Options, Fp16Options, Int8Options]
"""What a sharded reduce-scatter may put on the wire: fp32 (exact), bf16/fp16 casts, or int8 blocks (qgZ)."""


def check_sharded(spec: Options) -> GradientWire:
    """`spec` if it has a reduce-scatter form, else ValueError naming it (top-k, random-k, threshold and DGC
    select entries per rank and PowerSGD reduces low-rank factors: none yields the owner's chunk of a sum)."""
    if isinstance(spec, (NoCompression, Bf16Options, Fp16Options, Int8Options)):
        return spec
    raise ValueError(f"gradient compression {spec.method!r} cannot be combined with ZeRO (sharded gradients need a "
                     f"reduce-scatter; methods that have one: {SHARDED_METHODS})")


def options_label(options: Options) -> str:
    """The method's name, with the options that differ from its defaults: "powersgd", "powersgd(rank=1)"."""
    default = type(options)()
    changed = [f"{f.name}={getattr(options, f.name)!r}" for f in fields(options)
               if getattr(options, f.name) != getattr(default, f.name)]
    return f"{options.method}({', '.join(changed)})" if changed else options.method
