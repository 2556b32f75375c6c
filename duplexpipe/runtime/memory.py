"""Measured memory of one rank over a step: the bytes its tensors hold after each action, by kind, and the peaks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from duplexpipe.runtime.backward.checkpoint import RecomputeWatch
from duplexpipe.runtime.backward.compat import fsdp_held, nested_fsdp_records
from duplexpipe.runtime.saved_bytes import storage_key
from duplexpipe.runtime.stage_compute import Activation, Activations

KINDS = ("params", "grads", "activations", "messages")
"""What a sample counts, each kind per storage (a storage held twice within a kind counts once)."""
CURVES = (*KINDS, "unsharded_params", "total")
"""What `MemoryReport.curve_of` draws: each of KINDS, the unsharded part of the parameters, everything."""


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
    """Bytes of every parameter storage held: the unsharded ones (`unsharded_params`) and FSDP2's shards, which
    it keeps while a stage is unsharded too."""
    grads: int
    """Bytes of their gradients (under FSDP2 also the unreduced ones it keeps on a resharded stage until its
    reduce-scatter)."""
    activations: int
    """Bytes the live forwards keep for backward (`SavedBytes`, unioned per storage over the held microbatches) and
    what checkpointed regions' recomputes hold (from the recompute to the last use: I to W under a split backward)."""
    messages: int
    """Bytes of the mail: receive buffers not yet taken, sends not yet released, local handoffs and payloads
    waiting for their SEND."""
    total: int
    """Bytes of every storage above, each once (a sent output that is also saved for backward counts once)."""
    unsharded_params: int
    """The part of `params` held unsharded: a parameter outside FSDP2 whole (a tensor-parallel DTensor: its local
    shard), an FSDP2 parameter while its group is unsharded (its gathered storage); the rest of `params` is
    FSDP2's shards."""


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by this rank during one step, measured from the tensors it holds (`pipe.last.memory`,
    ObserveConfig.measure_memory): each kind's peak over the step's action boundaries, and the peak of their sum."""

    rank: int
    """The pipeline rank."""
    params_peak: int
    """Most bytes of unsharded parameters held at once (MemoryPoint.unsharded_params): what ZeRO-3's residency
    window bounds. FSDP2's shards, held throughout, are `params_sharded`; `total_peak` counts both."""
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
    params_sharded: int = 0
    """Most bytes of FSDP2's parameter shards held at once (ZeRO-2 and -3: 1/DP of the stages' parameters, padded,
    plus hpZ's node-local shards while held; 0 without FSDP2): the parameter bytes at rest."""

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
        """(seconds since the step's start, bytes) after each action, of one of CURVES."""
        if kind not in CURVES:
            raise ValueError(f"kind must be one of {', '.join(CURVES)}, got {kind!r}")
        return [(p.time, getattr(p, kind)) for p in self.curve]

    def summary(self) -> str:
        """One line: `rank 0: peak 1.2 MiB (params 40.0 KiB, param shards 0 B, grads ..., activations ...)`
        (params: the unsharded peak)."""
        cuda = "" if self.max_memory_allocated is None else f", cuda max allocated {_size(self.max_memory_allocated)}"
        offloaded = f", offloaded {_size(self.offloaded_bytes)}" if self.offloaded_bytes else ""
        return (f"rank {self.rank}: peak {_size(self.total_peak)} (params {_size(self.params_peak)}, param shards "
                f"{_size(self.params_sharded)}, grads "
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
        self.fsdp_records = [record for module in self.modules for record in nested_fsdp_records(module)]
        """FSDP2's parameter records of the stage modules (ZeRO-2 and -3; none otherwise): what they hold is
        read from them at each sample, unsharded parameters apart from shards."""
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
        fsdp = fsdp_held(self.fsdp_records)
        unsharded = storages(fsdp.unsharded)
        shards = storages(fsdp.shards)
        grads = storages(fsdp.grads)
        for module in self.modules:
            for param in module.parameters():
                if id(param) not in fsdp.managed:
                    storages((param,), unsharded)
                    storages((param.grad,), grads)
        params = {**shards, **unsharded}
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
                                      sum(total.values()), sum(unsharded.values())))

    def report(self) -> MemoryReport:
        """The step's report (the optimizer state is added by whoever steps the optimizer: `with_optimizer`)."""
        curve = tuple(self.curve)
        peaks = {kind: max((getattr(p, kind) for p in curve), default=0) for kind in CURVES}
        sharded = max((p.params - p.unsharded_params for p in curve), default=0)
        cuda = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return MemoryReport(self.rank, peaks["unsharded_params"], peaks["grads"], 0, peaks["activations"],
                            peaks["messages"], peaks["total"], cuda, curve, params_sharded=sharded)


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
