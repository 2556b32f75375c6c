"""The duplexpipe side of the A/B comparison: a training Pipeline (or a bare runtime), one step."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from duplexpipe.runtime import PipelineRuntime, RuntimeConfig, StepResult
from duplexpipe.schedules.ir import Schedule
from duplexpipe.schedules.registry import build
from duplexpipe.train.trainer import Pipeline, PipelineConfig


@dataclass
class OursPipe:
    """One rank's duplexpipe pipeline."""

    schedule: Schedule
    """The compute-only schedule the runtime executes."""
    modules: dict[int, nn.Module]
    """stage index -> this rank's copy of that stage's model part."""
    runtime: PipelineRuntime
    """The interpreter for this rank's list."""
    has_first: bool
    """True when this rank feeds the model input."""
    has_last: bool
    """True when this rank computes the loss."""
    last: StepResult | None = field(default=None)
    """The result of the latest step."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """One training step over the whole batch (the runtime splits it into microbatches)."""
        self.last = self.runtime.step(inputs if self.has_first else None,
                                      targets if self.has_last else None)
        return self.last

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)

    def group_grads(self) -> dict[int, list[torch.Tensor]]:
        """This rank's gradients by weight group (model part); mirrored copies are not summed here."""
        out: dict[int, list[torch.Tensor]] = {}
        for stage, module in self.modules.items():
            grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                     for p in module.parameters()]
            group = self.schedule.stages[stage].group
            if group in out:
                out[group] = [a + b for a, b in zip(out[group], grads, strict=True)]
            else:
                out[group] = grads
        return out


def build_ours(name: str, parts: list[nn.Module], rank: int, num_ranks: int, num_microbatches: int,
               loss: Callable[..., torch.Tensor], config: RuntimeConfig | None = None,
               schedule: Schedule | None = None) -> OursPipe:
    """Build schedule `name` (or use `schedule`) and a runtime over this rank's copies of `parts`.

    `parts[k]` is model part k (weight group k); every stage of that group gets its own copy.
    """
    sched = schedule if schedule is not None else build(name, num_ranks, num_microbatches)
    if sched.num_groups != len(parts):
        raise ValueError(f"{name} has {sched.num_groups} model parts, got {len(parts)} parts")
    modules = {s: copy.deepcopy(parts[sched.stages[s].group]) for s in sched.stages_of_rank(rank)}
    cfg = config if config is not None else RuntimeConfig()
    runtime = PipelineRuntime(sched, modules, loss, config=cfg)
    return OursPipe(sched, modules, runtime, any(sched.is_first(s) for s in modules),
                    any(sched.is_last(s) for s in modules))


def runtime_config(**overrides: Any) -> RuntimeConfig:
    """RuntimeConfig with the benchmark defaults, ignoring fields this runtime does not have."""
    fields = getattr(RuntimeConfig, "__dataclass_fields__", {})
    known = {k: v for k, v in overrides.items() if k in fields}
    return RuntimeConfig(**known)


def frozen_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with learning rate 0: the optimizer step runs (on both sides of the A/B), the weights stay
    put, so every step's gradients can be checked against the single-process reference."""
    return torch.optim.SGD(params, lr=0.0)


@dataclass
class OursTrainer:
    """One rank's duplexpipe training Pipeline: its step is Pipeline.step (zero_grad, the schedule, the
    loss on every rank, the optimizer step)."""

    pipe: Pipeline
    """The Pipeline."""
    has_first: bool
    """True when this rank feeds the model input."""
    has_last: bool
    """True when this rank computes the loss."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step over the whole batch."""
        return self.pipe.step(inputs if self.has_first else None, targets if self.has_last else None)

    def zero_grad(self) -> None:
        """Nothing: Pipeline.step zeroes the gradients itself, inside the timed step."""

    def group_grads(self) -> dict[int, list[torch.Tensor]]:
        """This rank's gradients by weight group (model part)."""
        out: dict[int, list[torch.Tensor]] = {}
        for stage, module in self.pipe.stage_modules.items():
            grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                     for p in module.parameters()]
            group = self.pipe.schedule.stages[stage].group
            out[group] = [a + b for a, b in zip(out[group], grads, strict=True)] if group in out else grads
        return out


def build_pipeline(name: str, parts: list[nn.Module], num_microbatches: int,
                   loss: Callable[..., torch.Tensor], **config: Any) -> OursTrainer:
    """A Pipeline over `parts` with the default PipelineConfig (plus `config` overrides) and `frozen_sgd`."""
    pipe = Pipeline(parts, loss, frozen_sgd, PipelineConfig(schedule=name, num_microbatches=num_microbatches,
                                                          **config))
    mine = pipe.stage_modules
    return OursTrainer(pipe, any(pipe.schedule.is_first(s) for s in mine), any(pipe.schedule.is_last(s) for s in mine))
