"""The torch.distributed.pipelining side of the A/B comparison: stages, schedule, one step."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed import pipelining as pp

# benchmark schedule key -> (torch schedule class name, placement of 2P stages or P stages)
TORCH_SCHEDULES: dict[str, tuple[str, str]] = {
    "1f1b": ("Schedule1F1B", "linear"),
    "gpipe": ("ScheduleGPipe", "linear"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "looped"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


def num_stages(placement: str, num_ranks: int) -> int:
    """How many stages a placement has on `num_ranks` ranks."""
    return num_ranks if placement == "linear" else 2 * num_ranks


def stages_of_rank(placement: str, num_ranks: int, rank: int) -> list[int]:
    """The stage indices `rank` holds under a placement (the same tables duplexpipe uses)."""
    if placement == "linear":
        return [rank]
    if placement == "looped":
        return [rank, rank + num_ranks]
    if placement == "v":
        return [rank, 2 * num_ranks - 1 - rank]
    raise ValueError(f"unknown placement {placement!r}; expected linear, looped or v")


@dataclass
class TorchPipe:
    """One rank's torch pipeline: its stage modules and the schedule object."""

    modules: dict[int, nn.Module]
    """stage index -> this rank's copy of that model part."""
    schedule: Any
    """The torch schedule instance."""
    has_first: bool
    """True when this rank feeds the model input."""
    has_last: bool
    """True when this rank computes the loss."""
    optimizer: torch.optim.Optimizer | None = None
    """Stepped after the schedule (and its gradients zeroed before it) when given: a training step."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """One training step over the whole batch; returns the per-microbatch losses held here."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        self.schedule.step(*args, target=targets if self.has_last else None, losses=losses,
                           return_outputs=False)
        if self.optimizer is not None:
            self.optimizer.step()
        return losses

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)


def build_torch_pipe(key: str, parts: list[nn.Module], rank: int, num_ranks: int,
                     num_microbatches: int, loss: Callable[..., torch.Tensor],
                     optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None) -> TorchPipe:
    """Wrap this rank's parts in PipelineStage objects and build torch's schedule `key` (with `optimizer`
    over this rank's parameters, a training step)."""
    if key not in TORCH_SCHEDULES:
        raise ValueError(f"no torch schedule for {key!r}; known: {sorted(TORCH_SCHEDULES)}")
    cls_name, placement = TORCH_SCHEDULES[key]
    total = num_stages(placement, num_ranks)
    if len(parts) != total:
        raise ValueError(f"{key} on {num_ranks} ranks needs {total} parts, got {len(parts)}")
    local = stages_of_rank(placement, num_ranks, rank)
    modules = {s: copy.deepcopy(parts[s]) for s in local}
    stages = [pp.PipelineStage(modules[s], s, total, torch.device("cpu")) for s in local]
    cls = getattr(pp, cls_name)
    stage_arg: Any = stages[0] if placement == "linear" else stages
    schedule = cls(stage_arg, num_microbatches, loss_fn=loss, scale_grads=True)
    params = [p for s in local for p in modules[s].parameters()]
    return TorchPipe(modules, schedule, 0 in local, total - 1 in local,
                     optimizer(params) if optimizer is not None else None)
