"""schedule="auto": profile the model parts on a sample microbatch, plan under a memory limit, build the winner."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.comm import Options
from duplexpipe.model.split import PartInfo, Partition
from duplexpipe.model.stages import PartInit, as_factory, materialize_part
from duplexpipe.planner.dp_comm import COMPRESSIONS
from duplexpipe.planner.memory import format_bytes, parse_bytes
from duplexpipe.planner.partition import balanced_split
from duplexpipe.planner.plan import PlanConfig, PlanResult, plan
from duplexpipe.planner.profile import Profile
from duplexpipe.runtime.structure import call, flatten, map_leaves, split
from duplexpipe.schedules.ir import Schedule
from duplexpipe.train.measure import Timer, profile_parts

AUTO = "auto"
"""The PipelineConfig.schedule value that plans the schedule (the registry's `auto` generator is one candidate)."""
NO_LIMIT = 2**62
"""The cap planned with when no memory_limit is given (bytes; no candidate is rejected for memory)."""
PROFILE_KEYS = ("repeats", "warmup", "timer", "fit_rows", "fused", "evict_bytes")
"""schedule_options keys that go to `profile_parts`."""
PLAN_KEYS = tuple(f.name for f in fields(PlanConfig) if f.name not in ("ranks", "batch", "memory", "dp"))
"""schedule_options keys that go to the planner's PlanConfig."""
LOGGER = logging.getLogger("duplexpipe.plan")


def memory_bytes(limit: int | str | None, what: str = "PipelineConfig.memory_limit") -> int | None:
    """A memory limit as bytes: an int > 0, a size text ("40GiB", "512 MiB"), or None; ValueError otherwise."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, str)):
        raise ValueError(f"{what} must be bytes (an int) or a size such as '40GiB', got {limit!r}")
    if isinstance(limit, int):
        if limit < 1:
            raise ValueError(f"{what} must be >= 1 byte, got {limit}")
        return limit
    try:
        return parse_bytes(limit)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def planned_compression(options: Options) -> str:
    """The planner's name (dp_model.COMPRESSIONS) for the gradient compression a Pipeline runs with; "none"
    (the reduction modelled uncompressed, said in the log) where the table has no measured ratio for it."""
    name = {"none": "none", "bf16": "bf16", "int8": "int8"}.get(options.method)
    rank, ratio = getattr(options, "rank", None), getattr(options, "ratio", None)
    if options.method == "powersgd" and rank in (1, 4):
        name = f"powersgd-r{rank}"
    if options.method == "dgc" and ratio == 0.01:
        name = "dgc"
    if name is None or name not in COMPRESSIONS:
        LOGGER.warning("schedule='auto': no measured wire ratio for grad_compression %r; the plan models the "
                       "data-parallel reduction uncompressed", options)
        return "none"
    return name


def check_options(options: dict[str, Any]) -> None:
    """Raise ValueError naming keys of schedule_options that schedule="auto" does not take."""
    unknown = sorted(set(options) - set(PROFILE_KEYS) - set(PLAN_KEYS))
    if unknown:
        raise ValueError(f"schedule='auto' takes schedule_options {', '.join(PLAN_KEYS + PROFILE_KEYS)}; "
                         f"got unknown {unknown}")


class PartChain(nn.Module):
    """Model parts run one after another, each called on the previous one's output as the runtime
    calls a stage (a tuple/list as positional arguments, a dict as keyword arguments)."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.parts[0](*args, **kwargs)
        for part in list(self.parts)[1:]:
            form, leaves = flatten(out, "output")
            out = call(part, form, leaves)
        return out


@dataclass(frozen=True)
class AutoChoice:
    """What schedule="auto" decided, the same on every rank."""

    result: PlanResult
    """The planner's result: every candidate, best first (`result.table()`)."""
    profile: Profile
    """Rank 0's profile of the given parts, on the sample's first microbatch."""
    schedule: Schedule
    """The winner, ready to run."""
    groups: tuple[int, ...]
    """How many of the given parts each of the schedule's model parts holds (contiguous, in order)."""

    def merged_parts(self, parts: Sequence[nn.Module]) -> list[nn.Module]:
        """The given parts as the schedule's model parts: a run of several becomes one PartChain."""
        out: list[nn.Module] = []
        start = 0
        for count in self.groups:
            run = list(parts[start:start + count])
            out.append(run[0] if count == 1 else PartChain(run))
            start += count
        return out

    def merged_init(self, init: PartInit | None) -> PartInit | None:
        """`init(part, k)` for the merged parts: each given part k inside a chain is filled by init(part, k)."""
        if init is None:
            return None
        firsts = [sum(self.groups[:g]) for g in range(len(self.groups))]

        def fill(module: nn.Module, group: int) -> None:
            inner = module.parts if isinstance(module, PartChain) else [module]
            for offset, part in enumerate(inner):
                init(part, firsts[group] + offset)
        return fill

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

    def summary(self) -> str:
        """The choice in one line."""
        best = self.result.best
        cap = self.result.config.memory
        limit = "no memory limit" if cap >= NO_LIMIT else f"limit {format_bytes(cap)} per rank"
        return (f"schedule='auto' chose {best.schedule} with M={best.microbatches} ({limit}): predicted step "
                f"{best.step_s * 1e3:.4g} ms, peak {format_bytes(best.peak_bytes)} per rank; the model's "
                f"{self.profile.num_parts} parts run as {len(self.groups)} (merged {list(self.groups)})")


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def _profile(parts: Sequence[nn.Module], loss_fn: Callable[[Any, Any], torch.Tensor], sample: tuple[Any, Any],
             num_microbatches: int, options: dict[str, Any], device: torch.device, init: PartInit | None,
             autocast: torch.dtype | None) -> Profile:
    """Profile copies of the parts on the sample's first microbatch (as the runtime would split it)."""
    inputs, targets = sample
    first = split(inputs, num_microbatches, "sample_input")[0]
    target = split(targets, num_microbatches, "sample_targets")[0] if targets is not None else None
    copies = [materialize_part(parts, k, device, init) for k in range(len(parts))]
    move = (lambda t: t.to(device))  # noqa: E731
    first = map_leaves(move, first)
    target = map_leaves(move, target) if target is not None else None
    kwargs = {k: options[k] for k in PROFILE_KEYS if k in options}
    with _autocast(device, autocast):
        return profile_parts(copies, first, target=target, loss_fn=loss_fn if target is not None else None,
                             meta={"source": "schedule='auto'"}, **kwargs)


def _shared_profile(make: Callable[[], Profile]) -> Profile:
    """Rank 0's profile on every rank (timings differ per process); a failure on rank 0 is raised everywhere."""
    if not (dist.is_available() and dist.is_initialized()):
        return make()
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload = [make().to_dict()]
        except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait forever
            payload = [f"{type(exc).__name__}: {exc}"]
            dist.broadcast_object_list(payload, src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], str):
        raise ValueError(f"schedule='auto': rank 0 failed to profile the model parts ({payload[0]})")
    return Profile.from_dict(payload[0], "rank 0's profile")


def choose(parts: Sequence[nn.Module] | Callable[[int], nn.Module], loss_fn: Callable[[Any, Any], torch.Tensor],
           *, ranks: int, dp: int, sample: tuple[Any, Any] | None, memory_limit: int | str | None,
           num_microbatches: int, options: dict[str, Any], device: torch.device, init: PartInit | None = None,
           autocast: torch.dtype | None = None, zero_stage: int = 0, compression: str = "none") -> AutoChoice:
    """Profile (rank 0, shared), plan for `ranks` x `dp` and the sample's batch size, log the choice once.

    `sample` is (inputs, targets) of one step's batch on this replica; the profiled microbatch
    is its first of `num_microbatches`. The plan keeps the Pipeline's own data-parallel settings
    (`zero_stage`, `compression`: a dp_model name) unless schedule_options sets zero_stages or
    compressions. Raises ValueError on every rank, before any training, when the parts or the
    sample are unusable or no candidate fits the limit (naming the smallest feasible cap).
    """
    check_options(options)
    cap = memory_bytes(memory_limit)
    if as_factory(parts) is not None:
        raise ValueError("schedule='auto' needs the model parts as a list (it merges neighbouring parts for the "
                         "chosen schedule); got a part factory")
    given = list(parts)  # type: ignore[arg-type]
    if sample is None or sample[0] is None:
        raise ValueError("schedule='auto' profiles the model on a sample: pass sample_input= (a batch as given to "
                         "step) and sample_targets= to the Pipeline")
    rows = int(flatten(sample[0], "sample_input")[1][0].shape[0])
    timer: Timer = options.get("timer", time.perf_counter)
    profile = _shared_profile(lambda: _profile(given, loss_fn, sample, num_microbatches,
                                               {**options, "timer": timer}, device, init, autocast))
    plan_options: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v)
                                    for k, v in options.items() if k in PLAN_KEYS}
    plan_options = {"zero_stages": (zero_stage,), "compressions": (compression,), **plan_options}
    config = PlanConfig(ranks=ranks, batch=rows * dp, memory=cap if cap is not None else NO_LIMIT, dp=dp,
                        **plan_options)
    result = plan(profile, config)
    schedule = result.schedule
    assert schedule is not None
    counts = balanced_split([p.forward_s + p.backward_s for p in profile.parts], schedule.num_groups)
    choice = AutoChoice(result, profile, schedule, tuple(counts))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        LOGGER.info("%s\n%s", choice.summary(), result.table())
    return choice
