"""ZeRO settings the trainer accepts: the stages, ZeRO++ options, and which (stage, gradient compression) pairs it
refuses; torch-free, so the planner enumerates only what the trainer runs."""

from __future__ import annotations

from dataclasses import dataclass

from duplexpipe.dp_options.compression import GradientWire, Int8Options, NoCompression, Options, check_sharded

ZERO_STAGES = (0, 1, 2, 3)
"""The ZeRO stages DataParallelConfig.zero_stage accepts."""


@dataclass(frozen=True)
class ZeroOptions:
    """ZeRO++ options for PipelineConfig(zero_stage=1, 2 or 3); the defaults send exact fp32."""

    quantized_gradients: bool | Int8Options = False
    """qgZ: reduce-scatter the gradients as int8 blocks (all_to_all of codes and fp32 block scales; each owner
    dequantizes and sums in fp32). True: Int8Options() (blocks of 256, stochastic rounding); or an
    Int8Options. The same as grad_compression="int8" with ZeRO (set one of the two)."""
    quantized_weights: bool | Int8Options = False
    """qwZ: all-gather the parameters as int8 blocks (ZeRO-3: every UNSHARD's all-gather); every replica's model
    weights are the same dequantized values while the optimizer's master shard stays in full precision. True:
    Int8Options(stochastic=False) (blocks of 256, round to nearest); or an Int8Options."""
    hpz_ranks: int | None = None
    """hpZ (zero_stage=2 or 3): a node-local secondary partition of the parameters over groups of this many
    consecutive data-parallel ranks (put one node's ranks there; FSDP2's post-forward mesh of
    reshard_after_forward=int), so only a step's first all-gather of a stage crosses nodes. ZeRO-2: FSDP2 reshards
    to it after each forward, so the backward's and later forwards' gathers stay inside a node; only for schedules
    without split backward (I/W). ZeRO-3: a stage's RESHARD actions reshard to it while another of its episodes
    follows in the call (those UNSHARDs gather inside the node); its last RESHARD shards it over the whole group
    again (at rest 1/DP); any schedule. Must divide the data-parallel size and be smaller; not with tensor
    parallelism. See docs/data-parallel.md. None: no secondary partition."""
    trust_elementwise: bool = False
    """Let ZeRO-1 step a flat shard with an optimizer not known to be elementwise (an optimizer that is not
    elementwise would give silently wrong updates)."""

    def __post_init__(self) -> None:
        for name in ("quantized_gradients", "quantized_weights"):
            value = getattr(self, name)
            if not isinstance(value, (bool, Int8Options)):
                raise ValueError(f"ZeroOptions.{name} must be a bool or comm.Int8Options, got {value!r}")
        if self.hpz_ranks is not None and (not isinstance(self.hpz_ranks, int) or isinstance(self.hpz_ranks, bool)
                                           or self.hpz_ranks < 2):
            raise ValueError(f"ZeroOptions.hpz_ranks must be an int >= 2 or None, got {self.hpz_ranks!r}")
        if not isinstance(self.trust_elementwise, bool):
            raise ValueError(f"ZeroOptions.trust_elementwise must be a bool, got {self.trust_elementwise!r}")

    @property
    def weight_wire(self) -> Int8Options | None:
        """The all-gather's int8 options (qwZ), or None for exact."""
        if isinstance(self.quantized_weights, Int8Options):
            return self.quantized_weights
        return Int8Options(stochastic=False) if self.quantized_weights else None

    @property
    def changed(self) -> bool:
        """True when any option differs from its default."""
        return self != ZeroOptions()


def check_zero_stage(stage: object) -> int:
    """`stage` if it is one of ZERO_STAGES; ValueError otherwise."""
    if stage not in ZERO_STAGES or isinstance(stage, bool):
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {stage!r}")
    return int(stage)  # type: ignore[call-overload]


def check_residency(stage: int, window: object, lookahead: object, gradients: object = None) -> None:
    """ZeRO-3's residency settings: `window` None or an int >= 1 (stages kept unsharded at once), `lookahead` an
    int >= 0 (how early an unshard is issued), `gradients` None or a bool (reshard_gradients); a window only with
    zero_stage=3, reshard_gradients only with a window. ValueError names the values."""
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"reshard_window must be an int >= 1 (stages kept unsharded at once) or None (all of a "
                         f"rank's stages), got {window!r}")
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
        raise ValueError(f"unshard_lookahead must be an int >= 0, got {lookahead!r}")
    if window is not None and stage != 3:
        raise ValueError(f"reshard_window={window} sets how many stages ZeRO-3 keeps unsharded; it needs "
                         f"zero_stage=3, got zero_stage={stage}")
    if gradients is not None and not isinstance(gradients, bool):
        raise ValueError(f"reshard_gradients must be True, False or None (where it holds fewer bytes), got "
                         f"{gradients!r}")
    if gradients is not None and window is None:
        raise ValueError(f"reshard_gradients={gradients} sets how a ZeRO-3 reshard window reduces gradients; it needs "
                         "reshard_window (zero_stage=3)")


def check_window(window: int | None, rank_stages: int, rank: int) -> int:
    """The residency window in stages for a rank holding `rank_stages` stages (None: all of them); ValueError when
    `window` exceeds them."""
    if window is None:
        return rank_stages
    if window > rank_stages:
        raise ValueError(f"reshard_window={window} is larger than the {rank_stages} stage(s) pipeline rank {rank} "
                         f"holds; use at most {rank_stages} (or None: all of them)")
    return window


def gradient_wire(stage: int, options: ZeroOptions, compression: Options) -> GradientWire:
    """What ZeRO's reduce-scatter sends, from grad_compression and ZeroOptions.quantized_gradients.

    Raises ValueError naming the values for methods without a reduce-scatter form (top-k, random-k,
    threshold, DGC, PowerSGD) and for qgZ set together with another grad_compression.
    """
    wire = check_sharded(compression) if stage else compression
    qgz = options.quantized_gradients
    if not qgz:
        return wire  # type: ignore[return-value]
    mine = qgz if isinstance(qgz, Int8Options) else Int8Options()
    if not isinstance(wire, NoCompression) and wire != mine:
        raise ValueError(f"ZeroOptions.quantized_gradients={qgz!r} and grad_compression={compression.method!r} "
                         "both say how gradients go on the wire; set one of them")
    return mine


def check_zero(stage: object, options: ZeroOptions, compression: Options, dp_strategy: str | None) -> int:
    """Check a configuration's ZeRO settings against each other; return the stage. ValueError names the values."""
    stage = check_zero_stage(stage)
    if not isinstance(options, ZeroOptions):
        raise ValueError(f"zero must be a ZeroOptions, got {options!r}")
    if stage == 0 and options.changed:
        raise ValueError(f"ZeroOptions {options} need zero_stage 1, 2 or 3, got zero_stage=0")
    if stage and dp_strategy is not None:
        raise ValueError(f"zero_stage={stage} chooses the data-parallel strategy itself; leave dp_strategy None "
                         f"(got {dp_strategy!r})")
    if options.hpz_ranks is not None and stage not in (2, 3):
        raise ValueError(f"ZeroOptions.hpz_ranks={options.hpz_ranks} keeps a node-local secondary partition of the "
                         f"parameters during a step, which needs zero_stage=2 or 3 (FSDP2's post-forward mesh), got "
                         f"zero_stage={stage}")
    gradient_wire(stage, options, compression)
    return stage


def zero_refusal(stage: int, compression: Options, options: ZeroOptions | None = None,
                 dp_strategy: str | None = None) -> str | None:
    """Why the trainer refuses ZeRO `stage` with `compression` (and `options`, `dp_strategy`), or None when it
    accepts the pair: `check_zero`'s verdict, for callers that enumerate pairs (the planner)."""
    try:
        check_zero(stage, options if options is not None else ZeroOptions(), compression, dp_strategy)
    except ValueError as exc:
        return str(exc)
    return None
