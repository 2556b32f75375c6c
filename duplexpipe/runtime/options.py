"""The runtime's configuration and the results of a step or an evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from duplexpipe.schedules.timeline import Timeline

OverlapHook = Callable[..., None]
"""`hook(pair, run_forward, run_backward)`: runs one OVERLAP_F_B pair.

`pair` is the OVERLAP_F_B Action; `run_forward()` and `run_backward()` run its two parts
(their inputs have already arrived). The hook must call each exactly once, in any order or
interleaving it likes (e.g. the forward's communication-heavy half while the backward computes).
"""


@dataclass
class RuntimeConfig:
    """How PipelineRuntime executes a schedule."""

    timeout_s: float = 180.0
    """Bound on every wait (receive, send completion, collective, handshake); a timeout raises
    PipelineTimeoutError naming the rank, the action and the peer."""
    record_timeline: bool = True
    """Measure every compute action's start and end and return them in StepResult.timeline."""
    autocast_dtype: torch.dtype | None = None
    """When set (e.g. torch.bfloat16), stage forwards and the loss run under torch.autocast."""
    sum_mirrored_grads: bool = True
    """DualPipe: at the end of each step, sum the gradients of the two stages that hold the same
    weight group (ranks s and P-1-s) so both copies carry the full gradient."""
    overlap_hook: OverlapHook | None = None
    """Runs an OVERLAP_F_B pair (see OverlapHook); None: the forward part, then the backward part,
    with the receives of both parts already waited for and their sends posted after the pair."""
    poll_interval_s: float = 0.05
    """How often a waiting rank checks the shared error flag (one store round trip per check)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"RuntimeConfig.timeout_s must be > 0, got {self.timeout_s}")
        if not self.poll_interval_s > 0:
            raise ValueError(f"RuntimeConfig.poll_interval_s must be > 0, got {self.poll_interval_s}")
        if self.autocast_dtype is not None and not isinstance(self.autocast_dtype, torch.dtype):
            raise ValueError(f"RuntimeConfig.autocast_dtype must be a torch.dtype or None, "
                             f"got {self.autocast_dtype!r}")
        if self.overlap_hook is not None and not callable(self.overlap_hook):
            raise ValueError(f"RuntimeConfig.overlap_hook must be callable, got {self.overlap_hook!r}")


@dataclass
class StepResult:
    """What one training step returns (on every rank)."""

    loss: float
    """Mean loss over the whole batch (before loss_scale), identical on every rank."""
    timeline: Timeline | None
    """This rank's measured compute events (source "measured", unit "s"); None when disabled."""
    peak_activations: int
    """The most (stage, microbatch) activations alive at once on this rank during the step."""


@dataclass
class EvalResult:
    """What one forward-only evaluation returns."""

    outputs: torch.Tensor | None
    """The last stage's outputs for the whole batch in batch order, on ranks holding a last stage;
    None elsewhere."""
    loss: float | None
    """Mean loss over the batch when targets were given (identical on every rank), else None."""
    timeline: Timeline | None
    """This rank's measured forward events; None when disabled."""
