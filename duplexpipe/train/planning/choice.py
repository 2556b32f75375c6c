"""What a Pipeline runs (`RunPlan`) and, with schedule="auto", what the planner chose (`AutoChoice`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import nn

from duplexpipe.dp_options.compression import AdaptiveOptions, Options, compression_options, options_label
from duplexpipe.model.split import PartInfo, Partition
from duplexpipe.model.stages import PartInit
from duplexpipe.planner.dp_comm import adaptive_start
from duplexpipe.planner.host_offload import offload_label
from duplexpipe.planner.plan import PlanResult
from duplexpipe.planner.profile import Profile
from duplexpipe.schedules.ir import Schedule
from duplexpipe.sizes import format_bytes
from duplexpipe.train.part_chain import merge_init, merge_parts
from duplexpipe.train.pipeline_config import AUTO_FIXED, PipelineConfig, with_choice

NO_LIMIT = 2**62
"""The cap planned with when no memory_limit is given (bytes; no candidate is rejected for memory)."""


@dataclass(frozen=True)
class RunPlan:
    """What a Pipeline runs: the schedule, M, ZeRO stage and gradient compression (and what auto predicted)."""

    schedule: str
    """The schedule, as the planner names it (with its options, e.g. "interleaved-1f1b(chunks=2)")."""
    microbatches: int
    """M."""
    zero_stage: int
    """The ZeRO stage (DataParallelConfig.zero_stage it runs with)."""
    grad_compression: Options
    """The gradient compression (DataParallelConfig.grad_compression it runs with)."""
    predicted_step_s: float | None = None
    """schedule="auto": the planner's predicted step time; None otherwise."""
    reshard_window: int | None = None
    """ZeRO-3's residency window (DataParallelConfig.reshard_window; None: all of a rank's stages)."""
    activation_checkpointing: bool | str = False
    """Every stage checkpointed: True (or "full") whole, "selective" under the selective policy; False: none
    (PipelineConfig.activation_checkpointing's value)."""
    activation_offload: bool | float = False
    """Activation offload (PipelineConfig.activation_offload's value): False, a fraction, or True."""

    @property
    def compression(self) -> str:
        """The compression's name with its non-default options ("none", "powersgd(rank=1)")."""
        return options_label(self.grad_compression)

    def summary(self) -> str:
        """One line: "zbv, M=8, ZeRO 0, gradient compression none (predicted step 12.3 ms)"."""
        zero = f"{self.zero_stage}" if self.zero_stage != 3 else \
            f"3 (reshard window {self.reshard_window or 'all'})"
        text = (f"{self.schedule}, M={self.microbatches}, ZeRO {zero}, gradient compression {self.compression}"
                + {False: "", "selective": ", selective activation checkpointing"}.get(
                    self.activation_checkpointing, ", activation checkpointing")
                + ("" if self.activation_offload is False else
                   f", activation offload {offload_label(self.activation_offload)}"))
        if self.predicted_step_s is None:
            return text
        return f"{text} (predicted step {self.predicted_step_s * 1e3:.4g} ms)"


@dataclass(frozen=True)
class AutoChoice:
    """What schedule="auto" decided, the same on every rank."""

    result: PlanResult
    """The planner's result: every candidate, best first (`result.table()`)."""
    profile: Profile
    """Rank 0's profile of the given parts (with the calibrated runtime work when the calibration ran)."""
    schedule: Schedule
    """The winner, ready to run."""
    groups: tuple[int, ...]
    """How many of the given parts each of the schedule's model parts holds (contiguous, in order)."""
    plan: RunPlan
    """What runs: the winner's schedule, M, ZeRO stage and gradient compression."""
    source: str = ""
    """Where the measurements came from ("measured", "cache <file>", ...)."""

    def merged_parts(self, parts: Sequence[nn.Module]) -> list[nn.Module]:
        """The given parts as the schedule's model parts: a run of several becomes one PartChain."""
        return merge_parts(parts, self.groups)

    def merged_init(self, init: PartInit | None) -> PartInit | None:
        """`init(part, k)` for the merged parts: each given part k inside a chain is filled by init(part, k)."""
        return merge_init(init, self.groups)

    def merged_partition(self, partition: Partition | None) -> Partition | None:
        """The given parts' Partition with the merged runs joined (None stays None)."""
        if partition is None:
            return None
        out, start = [], 0
        for g, count in enumerate(self.groups):
            run = partition.parts[start:start + count]
            times = [p.est_time_s for p in run]
            out.append(PartInfo(g, range(run[0].layers.start, run[-1].layers.stop), sum(p.num_params for p in run),
                                None if None in times else sum(t for t in times if t is not None),
                                run[0].has_embedding, run[-1].has_head))
            start += count
        return replace(partition, balance=tuple(len(p.layers) for p in out), parts=tuple(out))

    def applied(self, config: PipelineConfig) -> PipelineConfig:
        """`config` with the plan's M, ZeRO stage (ZeRO-3's window), gradient compression, checkpointing and offload
        set (and the schedule_options that searched them dropped): what runs."""
        p = self.plan
        options = {k: v for k, v in config.schedule_options.items() if k not in AUTO_FIXED.values()}
        given = config.data_parallel.grad_compression
        adaptive = compression_options(given) if given is not None else None
        grad = (adaptive_start(adaptive, p.grad_compression) if isinstance(adaptive, AdaptiveOptions)
                else p.grad_compression)  # adaptive starts on the planner's rung
        chosen = with_choice(replace(config, schedule_options=options), p.microbatches, p.zero_stage, grad)
        window = p.reshard_window if p.zero_stage == 3 else None
        return replace(chosen, data_parallel=replace(chosen.data_parallel, reshard_window=window),
                       activation_checkpointing=p.activation_checkpointing if p.activation_checkpointing is not False
                       else config.activation_checkpointing,
                       activation_offload=p.activation_offload if p.activation_offload is not False
                       else config.activation_offload)

    def summary(self) -> str:
        """The choice in one line."""
        best = self.result.best
        cap = self.result.config.memory
        limit = "no memory limit" if cap >= NO_LIMIT else f"limit {format_bytes(cap)} per rank"
        return (f"schedule='auto' chose {self.plan.summary()}; {limit}, peak {format_bytes(best.peak_bytes)} per rank "
                f"({self.result.decided}); "
                f"the model's {self.profile.num_parts} parts run as {len(self.groups)} (merged {list(self.groups)}); "
                f"measurements: {self.source or 'measured'}")
