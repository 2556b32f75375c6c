"""The runtime's configuration and the results of a step or an evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from duplexpipe.comm.codec import Codec, check_codec
from duplexpipe.comm.meter import WireMeter
from duplexpipe.dp_options.p2p import check_policy
from duplexpipe.fielddoc import documented
from duplexpipe.runtime.memory import MemoryReport
from duplexpipe.schedules.timeline import Timeline

GradsReadyHook = Callable[[int], None]
"""`hook(stage)`: this rank's gradients of `stage`'s parameters are final for the step.

Called once per stage of this rank per training step, as early as that is true: right after the
stage's last B or W on this rank, or, for DualPipe's mirrored stages, right after the end-of-step
mirror sum. A data-parallel strategy can start reducing that stage's gradients while the rest of
the step runs. An exception raised by the hook fails the step like any other.
"""


class Residency(Protocol):
    """What the schedule's UNSHARD / RESHARD / REDUCE_GRAD actions of a stage do (ZeRO-3's strategy implements it;
    `PipelineRuntime.drive_residency`). Every data-parallel peer runs the same list, so their collectives match."""

    def unshard_stage(self, stage: int) -> None:
        """UNSHARD: start gathering the stage's parameters (asynchronously)."""

    def wait_unshard(self, stage: int) -> None:
        """Right before each compute of the stage: its gathered parameters are in place once this returns."""

    def reshard_stage(self, stage: int) -> None:
        """RESHARD: free the stage's gathered parameters (keeping its unreduced gradients)."""

    def reduce_grad(self, stage: int) -> None:
        """REDUCE_GRAD: reduce the stage's gradients: once they are final on this rank for the step (when the call
        ends the accumulation window), or, where the list holds several per call (windowed gradients), what each
        episode accumulated, added into the sharded gradient."""

    def grad_holders(self, stage: int) -> list[Tensor]:
        """The tensors whose .grad hold the stage's unreduced gradients (DualPipe's mirror sum exchanges them)."""


@documented
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
    fb_overlap: bool = False
    """Run each OVERLAP_F_B pair's backward and forward interleaved at their comm points (the all-to-alls
    of MoE layers, `duplexpipe.runtime.fb_pair`): every exchange of one part is in flight while the other
    part computes. Stages without comm points run as one piece each (backward, then forward). False: the
    forward part, then the backward part, with the receives of both parts already waited for and their
    sends posted after the pair."""
    on_grads_ready: GradsReadyHook | None = None
    """Called with a stage index once this rank's gradients of that stage are final for the step
    (see GradsReadyHook); None: no call."""
    activation_codec: Codec | None = None
    """Encodes the activations sent to another rank that carry a gradient back into their wire payloads and
    decodes them on arrival (duplexpipe.comm.codec; e.g. CastCodec(torch.bfloat16)); None: sent as they are.
    Forward-only tensors (masks, positions, integers) and an activation holding NaN, inf or a float extreme
    when its message's shapes are announced travel exactly (duplexpipe.runtime.message_meta). Every rank
    must use the same codecs (checked at start-up)."""
    gradient_codec: Codec | None = None
    """The same for the gradients sent back to the previous stage's rank."""
    nonfinite_sends: str = "warn"
    """A tensor sent through a codec that holds NaN or inf (it always arrives non-finite): "warn" counts
    every such send (PipelineRuntime.nonfinite) and warns once naming rank, stage and microbatch; "raise"
    fails the step with NonFiniteSendError (see duplexpipe.comm.nonfinite)."""
    p2p_meter: WireMeter | None = None
    """When set, every SEND this rank posts is recorded in it as one "send" of the bytes of all its
    payloads (what goes on the wire, after the codec)."""
    poll_interval_s: float = 0.05
    """How often a waiting rank checks the shared error flag (one store round trip per check)."""
    check_inputs_every_step: bool = True
    """True: every step() and evaluate() starts with an all-reduce in which the ranks agree on
    the batch (size, shapes, dtype, target rows), so bad or mismatched inputs raise ValueError on
    every rank before anything runs and the runtime stays usable. False: step() agrees only on
    the first step and on the first step after an evaluate() (evaluate always agrees); the other
    steps skip the collective, and each rank holding inputs (targets) checks locally that they
    have the agreed shape and dtype (row count). A mismatch raises ValueError (expected vs got)
    on that rank, the other ranks stop with PeerFailedError, and the runtime must be rebuilt.
    Use False when every training batch has the same shapes."""
    count_saved_bytes: bool = False
    """Count, per training forward, the bytes it keeps for backward (`duplexpipe.runtime.saved_bytes`:
    what autograd saves plus the input leaves kept for I, parameters and the step's inputs and targets
    excluded, the rule `profile_parts` uses) and report each step's peak over this rank in
    StepResult.peak_saved_bytes. Off by default: a Python hook per saved tensor costs a few percent of an
    overhead-bound step. False: not counted (peak_saved_bytes stays 0)."""
    measure_memory: bool = False
    """Measure what this rank holds over each training step (`duplexpipe.runtime.memory`): after every action,
    the bytes of its stage modules' parameters and gradients, of the activations kept for backward (counted as
    count_saved_bytes counts them, per storage) and of the mail, each storage once; reported in
    StepResult.memory with the curve. Walks those tensors after every action, so off by default; False: the
    step runs its usual handlers (StepResult.memory is None)."""
    recv_lookahead: int = 2
    """On gloo, on steps whose message shapes are already known: how many receives from
    each peer are posted ahead of where the schedule lists them. Receive i from a peer is posted when the
    schedule reaches receive i - recv_lookahead from that peer (the first ones at the start of the step);
    0: where the schedule lists them; negative: every receive at the start of the step. A receive posted
    before its peer sends lets gloo move the data at once, saving a round trip of notifications and the
    thread wake-ups around it; each receive posted early holds its buffer that much longer (at most
    recv_lookahead extra buffers per peer). Ignored on NCCL, whose receives occupy the stream. With 0 and a
    schedule whose receives are listed right before their consumers, each receive is posted at its consumer
    (a baseline in which no transfer into this rank overlaps its compute)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"RuntimeConfig.timeout_s must be > 0, got {self.timeout_s}")
        if not self.poll_interval_s > 0:
            raise ValueError(f"RuntimeConfig.poll_interval_s must be > 0, got {self.poll_interval_s}")
        if self.autocast_dtype is not None and not isinstance(self.autocast_dtype, torch.dtype):
            raise ValueError(f"RuntimeConfig.autocast_dtype must be a torch.dtype or None, "
                             f"got {self.autocast_dtype!r}")
        if self.on_grads_ready is not None and not callable(self.on_grads_ready):
            raise ValueError(f"RuntimeConfig.on_grads_ready must be callable, got {self.on_grads_ready!r}")
        check_codec(self.activation_codec, "RuntimeConfig.activation_codec")
        check_codec(self.gradient_codec, "RuntimeConfig.gradient_codec")
        check_policy(self.nonfinite_sends, "RuntimeConfig.nonfinite_sends")
        if self.p2p_meter is not None and not isinstance(self.p2p_meter, WireMeter):
            raise ValueError(f"RuntimeConfig.p2p_meter must be a duplexpipe.comm.WireMeter or None, "
                             f"got {self.p2p_meter!r}")
        if not isinstance(self.recv_lookahead, int) or isinstance(self.recv_lookahead, bool):
            raise ValueError(f"RuntimeConfig.recv_lookahead must be an int, got {self.recv_lookahead!r}")
        for name in ("check_inputs_every_step", "count_saved_bytes", "fb_overlap", "measure_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RuntimeConfig.{name} must be a bool, got {getattr(self, name)!r}")


class StepResult:
    """What one training step returns (on every rank).

    `loss` is a property: the step posts the loss all-reduce without waiting for it, and the
    first read of `loss` waits (bounded by RuntimeConfig.timeout_s) unless the next step() or
    evaluate() on the runtime has already completed it.
    """

    __slots__ = ("_loss", "timeline", "peak_activations", "peak_saved_bytes", "memory")

    def __init__(self, loss: float | Callable[[], float], timeline: Timeline | None,
                 peak_activations: int, peak_saved_bytes: int = 0, memory: MemoryReport | None = None) -> None:
        self._loss = loss
        self.timeline = timeline
        """This rank's measured compute events (source "measured", unit "s"); None when disabled."""
        self.peak_activations = peak_activations
        """The most (stage, microbatch) activations alive at once on this rank during the step."""
        self.peak_saved_bytes = peak_saved_bytes
        """The most bytes those activations kept for backward at once on this rank during the step, each
        counted from the end of its F to the end of its B or W (RuntimeConfig.count_saved_bytes; 0 when off)."""
        self.memory = memory
        """What this rank held over the step, measured (RuntimeConfig.measure_memory; None when off)."""

    @property
    def loss(self) -> float:
        """Mean loss over the whole batch (before loss_scale), identical on every rank.

        Raises like a step would (PeerFailedError, PipelineTimeoutError) when the all-reduce fails.
        """
        if callable(self._loss):
            self._loss = float(self._loss())
        return self._loss

    def __repr__(self) -> str:
        loss = "<pending>" if callable(self._loss) else repr(self._loss)
        return (f"StepResult(loss={loss}, timeline={self.timeline!r}, peak_activations={self.peak_activations}, "
                f"peak_saved_bytes={self.peak_saved_bytes}, memory={self.memory!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepResult):
            return NotImplemented
        return ((self.loss, self.timeline, self.peak_activations, self.peak_saved_bytes, self.memory)
                == (other.loss, other.timeline, other.peak_activations, other.peak_saved_bytes, other.memory))

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces

    def __reduce__(self) -> tuple[Any, ...]:
        return (StepResult, (self.loss, self.timeline, self.peak_activations, self.peak_saved_bytes, self.memory))


@documented
@dataclass
class EvalResult:
    """What one forward-only evaluation returns."""

    outputs: Any
    """The last stage's outputs for the whole batch in batch order, on ranks holding a last stage
    (a tensor, or the structure the last stage returns, each leaf concatenated); None elsewhere."""
    loss: float | None
    """Mean loss over the batch when targets were given (identical on every rank), else None."""
    timeline: Timeline | None
    """This rank's measured forward events; None when disabled."""
