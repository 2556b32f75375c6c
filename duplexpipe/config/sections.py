"""The sections of `PipelineConfig`, torch-free: precision, data parallelism, safety and observation, each checked
when built, with the names and checks of their fields (data-parallel strategies, bucket size, non-finite policies)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from duplexpipe.config.precision import Float8Options, LossScaleConfig, check_precision, float8_options
from duplexpipe.dp_options.compression import Options, compression_options
from duplexpipe.dp_options.p2p import check_policy, holds_objects, p2p_labels
from duplexpipe.dp_options.zero import ZeroOptions, check_residency
from duplexpipe.fielddoc import documented

MAX_TIMEOUT_S = 7 * 24 * 3600
"""Longest bound on one wait (`SafetyConfig.timeout_s`, `compile_timeout_s`): a week; longer is no bound at all (and
torch's process-group timeouts overflow long before infinity)."""
STRATEGY_NAMES = ("replicated", "compressed")
"""The names DataParallelConfig.dp_strategy accepts (None picks one from grad_compression)."""
DEFAULT_BUCKET_BYTES = 32 * 2**20
"""Default bucket capacity (one parameter larger than this gets a bucket of its own)."""
NONFINITE_GRADS = ("raise", "skip")
"""SafetyConfig.nonfinite_grads values: stop every rank with NonFiniteGradientError, or skip the step everywhere."""


def check_strategy_name(name: str | None, compressing: bool) -> None:
    """Raise ValueError for an unknown strategy name, or one that cannot apply the requested compression."""
    if name is not None and name not in STRATEGY_NAMES:
        raise ValueError(f"unknown dp_strategy {name!r}; expected one of {STRATEGY_NAMES} or None")
    if name == "replicated" and compressing:
        raise ValueError("dp_strategy 'replicated' all-reduces exact gradients; with grad_compression set "
                         "use 'compressed' (or None)")


def check_nonfinite_policy(value: object) -> None:
    """ValueError naming the value unless it is one of NONFINITE_GRADS."""
    if value not in NONFINITE_GRADS:
        raise ValueError(f"SafetyConfig.nonfinite_grads must be one of {', '.join(NONFINITE_GRADS)}, got {value!r}")


@documented
@dataclass
class PrecisionConfig:
    """The precision of the compute and of the stage-to-stage sends."""

    dtype: str = "fp32"
    """"fp32"; "bf16" (bfloat16 autocast); or "fp16" (float16 autocast with dynamic loss scaling)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling settings, used with dtype "fp16"."""
    p2p_compression: Any = None
    """Low-precision stage-to-stage sends: None (as computed), "bf16" (bf16 both ways), "fp8" (e4m3
    activations, e5m2 gradients, an fp32 scale per row) or "int8" (blocks of 256, fp32 scale per block), with
    options as in "int8(block=128)"; or a duplexpipe.comm.codec.Codec for both directions, or an (activation,
    gradient) pair of names, codecs or None (or "fp8, none"). See duplexpipe.comm.p2p_codecs."""
    float8: str | Float8Options | None = None
    """Float8 compute on torchao's Float8Linear: None (off), a recipe "tensorwise" or "rowwise", with options as in
    "rowwise(emulate=true)", or a `config.precision.Float8Options`. Each stage's linears whose dimensions are divisible
    by 16 convert, except the output projection, MoE routers and MoE blocks (kept in high precision, logged); the
    weights stay high-precision parameters (checkpoints unchanged). emulate unset: emulated where the device has no
    FP8 GEMMs (CPU, CUDA below 8.9), said in the log. Under a split backward I forms the input gradients and W the
    weight gradients, each with its own scaling."""

    def __post_init__(self) -> None:
        check_precision(self.dtype)
        if holds_objects(p2p_labels(self.p2p_compression, "PrecisionConfig.p2p_compression")):
            from duplexpipe.comm.p2p_codecs import p2p_codec_pair  # a Codec object: checked by comm (torch)

            p2p_codec_pair(self.p2p_compression, "PrecisionConfig.p2p_compression")
        float8_options(self.float8)


@documented
@dataclass
class DataParallelConfig:
    """How the data-parallel replicas reduce gradients and shard optimizer state (no effect without replicas)."""

    grad_compression: str | Options | None = None
    """Data-parallel gradient compression: a method name ("bf16", "fp16", "powersgd", "int8", "topk", "randomk",
    "threshold", "dgc"; `duplexpipe.dp_options.compression.METHOD_NAMES`) with its defaults or with options as in
    "powersgd(rank=1)", or an options object from `duplexpipe.dp_options.compression` (e.g. Int8Options(block=128),
    DGCOptions(ratio=0.001, warmup_steps=20)); "none": exact fp32 all-reduce. None (unset): exact, or with
    schedule="auto" the planner's choice among its measured methods that this configuration accepts
    (`planner.dp_comm.COMPRESSIONS`; schedule_options["compressions"] narrows them); set (also "none"), it is fixed.
    Sparsifiers assume SGD (DGC: SGD with momentum=0, the momentum and the gradient clipping go in DGCOptions,
    grad_clip_norm must be None). No effect (a warning) without data parallelism."""
    dp_strategy: str | None = None
    """Data-parallel strategy name (duplexpipe.parallel.STRATEGY_NAMES); None: "compressed" when
    grad_compression compresses, else "replicated"."""
    grad_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Gradients are reduced in fixed buckets of at most this many bytes, each started as soon as its
    gradients are final (in the order they become final)."""
    zero_stage: int | None = None
    """ZeRO over the data-parallel replicas: 0 none; 1 optimizer state sharded (reduce-scatter, step on the
    shard, all-gather; an elementwise optimizer such as SGD/Adam/AdamW); 2 gradients sharded too (torch
    FSDP2, reduced stage by stage as they become final); 3 parameters sharded too at rest (FSDP2 driven by the
    schedule's UNSHARD / RESHARD / REDUCE_GRAD actions per stage, see reshard_window).
    grad_compression may be "bf16", "fp16" or "int8" (int8 = ZeRO++ qgZ) with ZeRO. None (unset): 0, or with
    schedule="auto" the planner's choice among the stages this configuration accepts; set, it is fixed."""
    zero: ZeroOptions = field(default_factory=ZeroOptions)
    """ZeRO++ options for zero_stage 1, 2 and 3: quantized_gradients (qgZ), quantized_weights (qwZ), hpz_ranks
    (zero_stage 2 or 3: a node-local secondary partition)."""
    reshard_window: int | None = None
    """zero_stage=3: how many of a rank's stages may hold unsharded parameters at once (the schedule gets an
    UNSHARD before a stage's use and a RESHARD once the window needs its room); None: all of the rank's stages (one
    all-gather and one reduce-scatter per stage per step). At least 1, at most the stages of a rank."""
    unshard_lookahead: int = 1
    """zero_stage=3: how many compute actions ahead of a stage's first use its UNSHARD (all-gather) is issued, so
    it overlaps the compute before it (0: right before the use)."""
    reshard_gradients: bool | None = None
    """zero_stage=3 with a reshard_window smaller than a rank's stages: True reduce-scatters a stage's gradients
    after each of its episodes that ran a backward (into its sharded gradient: one stage's whole gradient at a time,
    more reduce-scatters), False once per step (every stage's gradient whole until then); None: True where that
    holds fewer bytes (window + stages / dp < stages: from dp=3 with two stages per rank and a window of one)."""

    def __post_init__(self) -> None:
        if not isinstance(self.grad_bucket_bytes, int) or self.grad_bucket_bytes < 1:
            raise ValueError(f"grad_bucket_bytes must be an int >= 1, got {self.grad_bucket_bytes!r}")
        compression_options(self.grad_compression)
        check_residency(self.zero_stage or 0, self.reshard_window, self.unshard_lookahead, self.reshard_gradients)


@documented
@dataclass
class SafetyConfig:
    """Bounds and checks: how long a wait may last, what is compared across ranks, what NaN or inf does."""

    timeout_s: float = 180.0
    """Seconds a blocked receive or send may wait before the runtime raises."""
    compile_timeout_s: float = 1800.0
    """With `compile` (or stages the user compiled on this rank): the bound on every wait of the first step and of
    the first evaluation, which compile (inductor can take minutes on a large model), in place of `timeout_s`;
    later steps that recompile are bounded by `timeout_s`."""
    check_inputs_every_step: bool = True
    """False: the ranks agree on the batch shape on the first step only (faster when every batch has
    the same shape; a differently shaped batch then stops every rank with an error). See RuntimeConfig."""
    check_replicas: bool = True
    """At construction, check that every copy of a model part (DualPipe mirrors, data-parallel
    replicas) starts with identical weights; raise ValueError otherwise."""
    nonfinite_grads: str = "raise"
    """What a step whose gradients hold NaN or inf does (checked on every step, one all-reduce with the gradient
    norm): "raise" (the default: every rank stops with NonFiniteGradientError naming the step and the first stage
    and parameter, before the optimizer steps) or "skip" (the step is skipped on every rank and counted in
    `Pipeline.skipped_steps`, as fp16 overflows are). With precision "fp16" an overflow is the loss scaler's: the
    step is skipped and the scale lowered, whatever this says."""
    nonfinite_sends: str = "warn"
    """A compressed send holding NaN or inf (it always arrives non-finite): "warn" (count it, warn once) or
    "raise" (stop every rank; not with precision "fp16", whose overflow steps are routine)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "compile_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
            if not value <= MAX_TIMEOUT_S:
                raise ValueError(f"{name} must be at most {MAX_TIMEOUT_S:,} seconds (a week), got {value!r}")
        check_policy(self.nonfinite_sends, "SafetyConfig.nonfinite_sends")
        check_nonfinite_policy(self.nonfinite_grads)


@documented
@dataclass
class ObserveConfig:
    """What a step measures and records about itself."""

    record_timeline: bool = True
    """Record the measured timeline of every step (StepInfo.timeline): this rank's own events, kept on the rank
    (gathering them is a separate, collective step: `runtime.gather_timeline`)."""
    record_tp_lane: bool = False
    """With tensor parallelism and record_timeline: time DTensor's collectives on the timeline's "tp" lane
    (`tp.lane`). A dispatch mode then sees every operator of the step: measured +11-21% CPU per step on
    an overhead-bound PP=2 x TP=2 GPT (4 gloo ranks, 2 cores), hence off by default."""
    count_saved_bytes: bool = False
    """Measure each step's peak saved-activation bytes per rank (`StepInfo.peak_saved_bytes`, counted as
    `profile_parts` counts them). Off by default (a hook per saved tensor, a few percent of an overhead-bound
    step); False: peak_saved_bytes stays 0."""
    measure_memory: bool = False
    """Measure what each rank holds over every step (`StepInfo.memory`, a `MemoryReport`): the bytes of its
    parameters (unsharded ones as they appear), gradients, optimizer state, saved activations and in-flight
    messages, each kind's peak and the peak of their sum over the step's actions, with the curve after each
    action (on CUDA also torch.cuda.max_memory_allocated). Walks those tensors after every action, so off by
    default; `duplexpipe train --measure-memory` prints the peaks in its summary."""
