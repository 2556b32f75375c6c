"""`StepInfo` (what a step did) and `runtime_config` (a PipelineConfig as the runtime's settings); `PipelineConfig`,
its sections and their checks live in the torch-free `duplexpipe.config` and are importable from here too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from duplexpipe.comm.adaptive import CompressionReport, ExposureReport
from duplexpipe.comm.meter import WireMeter
from duplexpipe.comm.p2p_codecs import p2p_codec_pair
from duplexpipe.config.pipeline import (
    AUTO,
    AUTO_CALIBRATION_KEYS,
    AUTO_FIXED,
    AUTO_PLAN_KEYS,
    AUTO_PROFILE_KEYS,
    DEFAULT_MICROBATCHES,
    SCHEDULE_FILES,
    PipelineConfig,
    check_auto_options,
    check_schedule_name,
    fixed_choice,
    is_schedule_file,
    with_choice,
    with_defaults,
)
from duplexpipe.config.sections import (
    MAX_TIMEOUT_S,
    DataParallelConfig,
    ObserveConfig,
    PrecisionConfig,
    SafetyConfig,
)
from duplexpipe.fielddoc import documented
from duplexpipe.runtime import RuntimeConfig
from duplexpipe.runtime.config import GradsReadyHook
from duplexpipe.runtime.memory import MemoryReport
from duplexpipe.schedules.timeline import Timeline
from duplexpipe.train.precision import autocast_dtype

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
"""Builds an LR scheduler on the optimizer, e.g. `lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f)`."""
LossFn = Callable[[Any, Any], torch.Tensor]
"""loss_fn(last stage output, targets) -> scalar mean loss over the microbatch."""


def runtime_config(config: PipelineConfig, *, fb_overlap: bool, on_grads_ready: GradsReadyHook | None,
                   p2p_meter: WireMeter | None) -> RuntimeConfig:
    """The runtime's settings for `config` (a Pipeline's, and its planner's calibration runs'): `fb_overlap` as the
    stages decided it (`Experts.note_overlap`), the data-parallel strategy's grads-ready hook and the send meter."""
    act_codec, grad_codec = p2p_codec_pair(config.precision.p2p_compression, "PrecisionConfig.p2p_compression")
    safety, observe = config.safety, config.observe
    return RuntimeConfig(timeout_s=safety.timeout_s, record_timeline=observe.record_timeline,
                         autocast_dtype=autocast_dtype(config.precision.dtype),
                         check_inputs_every_step=safety.check_inputs_every_step,
                         count_saved_bytes=observe.count_saved_bytes,
                         measure_memory=observe.measure_memory, activation_codec=act_codec,
                         gradient_codec=grad_codec, nonfinite_sends=safety.nonfinite_sends, p2p_meter=p2p_meter,
                         on_grads_ready=on_grads_ready, fb_overlap=fb_overlap)


@documented
@dataclass(frozen=True)
class StepInfo:
    """What the last `Pipeline.step` call did."""

    loss: float
    """Mean loss of the batch (averaged over data-parallel replicas); unscaled."""
    applied: bool
    """True when this call ended an accumulation window and the optimizer stepped."""
    skipped: bool
    """True when the window's gradients held NaN or inf (an fp16 overflow, or nonfinite_grads="skip") and the step
    was skipped everywhere."""
    grad_norm: float | None
    """Global gradient norm before clipping, at the end of every accumulation window (None mid-window); NaN or inf
    when the gradients held such values (never a masked number)."""
    loss_scale: float
    """The loss scale this call used (1.0 unless fp16)."""
    timeline: Timeline | None
    """This rank's measured timeline of the call (None when not recorded); on window ends its spans show
    the data-parallel bucket reductions on lane "dp"."""
    wire_bytes: float = 0.0
    """Ring-model bytes this rank sent for data-parallel gradient reduction in this call (comm.WireMeter)."""
    peak_saved_bytes: int = 0
    """The most bytes this rank's live activations kept for backward at once during the call, counted
    as `profile_parts` counts them (see StepResult.peak_saved_bytes)."""
    memory: MemoryReport | None = None
    """What this rank held during the call, measured (ObserveConfig.measure_memory; None when off), the optimizer
    state included."""
    exposure: ExposureReport | None = None
    """Exposed communication of the call: per data-parallel bucket the time from the end of the window's compute until
    its reduction completed, per stage link the time this rank's receives blocked. A recorded timeline shows the
    waits on lane "exposed"."""
    compression: CompressionReport | None = None
    """grad_compression="adaptive" and / or p2p_compression="adaptive": the rung each bucket ("bucket i", on window
    ends) and each directed stage link ("link a->b") used in the call, their measured exposure and the moves made at
    its end from the previous call's agreed exposure (None without adaptive compression)."""


__all__ = ["AUTO", "AUTO_CALIBRATION_KEYS", "AUTO_FIXED", "AUTO_PLAN_KEYS", "AUTO_PROFILE_KEYS", "DEFAULT_MICROBATCHES",
           "MAX_TIMEOUT_S", "SCHEDULE_FILES", "DataParallelConfig", "LossFn", "ObserveConfig", "PipelineConfig",
           "PrecisionConfig", "SafetyConfig", "SchedulerFactory", "StepInfo", "check_auto_options",
           "check_schedule_name", "fixed_choice", "is_schedule_file", "runtime_config", "with_choice", "with_defaults"]
