"""Measured memory of one rank over a step: the bytes its tensors hold after each action, by kind, and the peaks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from duplexpipe.runtime.backward.checkpoint import RecomputeWatch
from duplexpipe.runtime.saved_bytes import storage_key
from duplexpipe.runtime.stage_compute import Activation, Activations

KINDS = ("params", "grads", "activations", "messages")
"""What a sample counts, each kind per storage (a storage held twice within a kind counts once)."""


@dataclass(frozen=True)
class MemoryPoint:
    """What this rank held right after one action (or, inside an F&B pair, right after its forward part; inside a
    backward, right after a checkpointed region's recompute)."""

    label: str
    """The action (its text form, e.g. "1F3"), "start", "end" (sends released) or "recompute" (inside the action
    after it: a checkpointed region's recompute, its tensors all held)."""
    time: float
    """Seconds since the step's start (the measured timeline's clock)."""
    params: int
    """Bytes of the stage modules' parameters (a DTensor's local shard; an unsharded parameter as it is)."""
    grads: int
    """Bytes of their gradients."""
    activations: int
    """Bytes the live forwards keep for backward (`SavedBytes`, unioned per storage over the held microbatches) and
    what checkpointed regions' recomputes hold (from the recompute to the last use: I to W under a split backward)."""
    messages: int
    """Bytes of the mail: receive buffers not yet taken, sends not yet released, local handoffs and payloads
    waiting for their SEND."""
    total: int
    """Bytes of every storage above, each once (a sent output that is also saved for backward counts once)."""


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by this rank during one step, measured from the tensors it holds (`pipe.last.memory`,
    ObserveConfig.measure_memory): each kind's peak over the step's action boundaries, and the peak of their sum."""

    rank: int
    """The pipeline rank."""
    params_peak: int
    """Most parameter bytes held at once (FSDP2's unsharded parameters count while they are unsharded)."""
    grads_peak: int
    """Most gradient bytes held at once."""
    optimizer: int
    """Optimizer-state bytes held after the step's optimizer step (0 from the runtime alone; `with_optimizer`)."""
    activations_peak: int
    """Most bytes kept for backward at once, each forward's from its end to the end of its B or W."""
    messages_peak: int
    """Most bytes of messages in flight at once (see MemoryPoint.messages)."""
    total_peak: int
    """The peak over the action boundaries of everything held (each storage once), plus the optimizer state:
    the largest sum, not the sum of the peaks."""
    max_memory_allocated: int | None = None
    """CUDA: torch.cuda.max_memory_allocated over the step (reset at its start); None elsewhere."""
    curve: tuple[MemoryPoint, ...] = ()
    """What was held after each action, in order."""
    offloaded_bytes: int = 0
    """Bytes of saved activations copied to host memory during the step (PipelineConfig.activation_offload; each
    came back before its backward); the activations counted here leave out those on host."""

    def with_optimizer(self, during: int, after: int) -> MemoryReport:
        """This report with the optimizer state: `during` bytes held while the actions ran, `after` bytes once the
        optimizer stepped (its first step creates them), when everything the step's end held is still there."""
        end = self.curve[-1].total if self.curve else 0
        return replace(self, optimizer=after, total_peak=max(self.total_peak + during, end + after))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (the curve as a list of dicts)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "curve"},
                "curve": [asdict(p) for p in self.curve]}

    def curve_of(self, kind: str = "total") -> list[tuple[float, int]]:
        """(seconds since the step's start, bytes) after each action, of one of KINDS or "total"."""
        if kind not in (*KINDS, "total"):
            raise ValueError(f"kind must be one of {', '.join((*KINDS, 'total'))}, got {kind!r}")
        return [(p.time, getattr(p, kind)) for p in self.curve]

    def summary(self) -> str:
        """One line: `rank 0: peak 1.2 MiB = params 40.0 KiB, grads ..., activations ...`."""
        cuda = "" if self.max_memory_allocated is None else f", cuda max allocated {_size(self.max_memory_allocated)}"
        offloaded = f", offloaded {_size(self.offloaded_bytes)}" if self.offloaded_bytes else ""
        return (f"rank {self.rank}: peak {_size(self.total_peak)} (params {_size(self.params_peak)}, grads "
                f"{_size(self.grads_peak)}, optimizer {_size(self.optimizer)}, activations "
                f"{_size(self.activations_peak)}, messages {_size(self.messages_peak)}{cuda}{offloaded})")


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - the loop returns


def storages(tensors: Iterable[Tensor | None], into: dict[int, int] | None = None) -> dict[int, int]:
    """Storage address -> bytes of `tensors` (a DTensor: its local shard), each storage once."""
    found = {} if into is None else into
    for tensor in tensors:
        if tensor is not None:
            address, nbytes = storage_key(tensor)
            found[address] = nbytes
    return found


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in `optimizer`'s state, each storage once."""
    found: dict[int, int] = {}
    for state in optimizer.state.values():
        storages((v for v in state.values() if isinstance(v, Tensor)), found)
    return sum(found.values())


class StepMemory:
    """One step's measurement on one rank: samples what the rank holds (parameters and gradients of its stage
    modules, live activations, the mail) at each action boundary and keeps the curve and the peaks. Created by the
    runtime per step when RuntimeConfig.measure_memory is set (Step.memory), dropped with the step."""

    def __init__(self, rank: int, modules: Mapping[int, nn.Module], acts: Activations,
                 mail: Callable[[], list[Tensor]], device: torch.device, origin: float) -> None:
        self.rank = rank
        self.modules = list(modules.values())
        self.acts = acts
        self.mail = mail
        """Returns the tensors the mail holds now (the step's Mailbox and the transport's)."""
        self.device = device
        self.origin = origin
        self.curve: list[MemoryPoint] = []
        self.recomputes = RecomputeWatch(on_recompute=lambda: self.sample("recompute"))
        """The checkpointed regions of the step's forwards (collecting while the step's actions run): what their
        recomputes hold counts as activations, and each recompute is sampled (inside its I or B)."""
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def sample(self, label: str) -> None:
        """Record what this rank holds now."""
        params: dict[int, int] = {}
        grads: dict[int, int] = {}
        for module in self.modules:
            for param in module.parameters():
                storages((param,), params)
                storages((param.grad,), grads)
        saved: dict[int, int] = {}
        for act in self.acts.held.values():
            if act.saved is not None:
                saved.update(act.saved)
        held = storages(self.recomputes.held())  # a recompute saves views of the weights too: counted as params
        saved.update((address, nbytes) for address, nbytes in held.items() if address not in params)
        messages = storages(self.mail())
        total = {**params, **grads, **saved, **messages}
        self.curve.append(MemoryPoint(label, time.perf_counter() - self.origin, sum(params.values()),
                                      sum(grads.values()), sum(saved.values()), sum(messages.values()),
                                      sum(total.values())))

    def report(self) -> MemoryReport:
        """The step's report (the optimizer state is added by whoever steps the optimizer: `with_optimizer`)."""
        curve = tuple(self.curve)
        peaks = {kind: max((getattr(p, kind) for p in curve), default=0) for kind in (*KINDS, "total")}
        cuda = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return MemoryReport(self.rank, peaks["params"], peaks["grads"], 0, peaks["activations"], peaks["messages"],
                            peaks["total"], cuda, curve)


class MeasuredActivations(Activations):
    """Activations that sample the step's memory each time a forward's activation is held (so an F&B pair's
    forward part is seen before its backward part releases)."""

    __slots__ = ("memory",)

    def __init__(self, rank: int = 0) -> None:
        super().__init__(rank)
        self.memory: StepMemory | None = None

    def hold(self, stage: int, microbatch: int, act: Activation) -> None:
        """Activations.hold, then a sample."""
        super().hold(stage, microbatch, act)
        if self.memory is not None:
            self.memory.sample(f"{stage}F{microbatch} (held)")


def measured(handler: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """`handler(step, action)` followed by a sample of the step's memory, labelled with the action."""
    def run(step: Any, action: Any) -> None:
        handler(step, action)
        step.memory.sample(str(action))
    return run
