"""Per-step state of the interpreter: inputs, kept activations, local handoffs, losses."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from duplexpipe.runtime import structure
from duplexpipe.runtime.message_meta import Message, MessageMeta
from duplexpipe.runtime.stage_compute import Activation
from duplexpipe.schedules.ir import Action, Op

if TYPE_CHECKING:
    from duplexpipe.runtime.transport import Key

Slot = tuple[int, int]
"""(stage, microbatch)."""


@dataclass
class StepContext:
    """Everything one step (or evaluation) of one rank keeps; dropped when the step ends."""

    train: bool
    """True for step(), False for evaluate() (no autograd, F actions only)."""
    step: int
    """The step number (equal on every rank; names this step's shape announcements)."""
    learning: bool
    """True when activation shapes are announced through the store (new input shapes)."""
    shapes: dict[Slot, MessageMeta]
    """(receiving stage, microbatch) -> the activation message's meta: cached, or filled while learning."""
    weights: list[float]
    """Microbatch m's share of the batch (rows_m / rows); its loss is scaled by it."""
    signature: int = 0
    """Hash of the microbatch input shapes (keys the activation-shape cache)."""
    has_targets: bool = False
    """True when the ranks holding last stages were given targets (a loss is computed)."""
    loss_scale: float = 1.0
    """Extra factor on the loss before backward (gradients scale with it, the loss does not)."""
    inputs: dict[int, Message] = field(default_factory=dict)
    """microbatch -> input rows (ranks holding a first stage)."""
    targets: dict[int, Any] = field(default_factory=dict)
    """microbatch -> target rows (ranks holding a last stage), a tensor or a structure."""
    acts: dict[Slot, Activation] = field(default_factory=dict)
    """What backward needs, from F until B or W."""
    out_meta: dict[Slot, MessageMeta] = field(default_factory=dict)
    """The meta of each output this rank sent to another rank (the gradients it will receive)."""
    local_fwd: dict[Slot, Message] = field(default_factory=dict)
    """Activations handed to the next stage on this rank: (consumer stage, microbatch)."""
    local_grad: dict[Slot, list[Tensor]] = field(default_factory=dict)
    """Output gradients handed to the previous stage on this rank: (consumer stage, microbatch)."""
    outbox: dict[Key, list[Tensor]] = field(default_factory=dict)
    """Payloads produced for a SEND action that has not run yet."""
    losses: list[Tensor] = field(default_factory=list)
    """Each local microbatch's loss (detached)."""
    loss_weights: list[float] = field(default_factory=list)
    """The weight of each of `losses` (its microbatch's share of the batch)."""
    outputs: dict[int, Any] = field(default_factory=dict)
    """evaluate(): microbatch -> last-stage output (detached)."""
    live: int = 0
    """Activations alive now on this rank."""
    peak: int = 0
    """The most activations alive at once so far."""
    live_bytes: int = 0
    """Bytes the live activations keep for backward (their `Activation.saved_bytes`)."""
    peak_bytes: int = 0
    """The most such bytes alive at once so far."""

    def activation_born(self, nbytes: int = 0) -> None:
        """One more live activation, keeping `nbytes` for backward."""
        self.live += 1
        self.peak = max(self.peak, self.live)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def activation_freed(self, nbytes: int = 0) -> None:
        """One live activation fewer (its backward is done), releasing `nbytes`."""
        self.live -= 1
        self.live_bytes -= nbytes

    def leftovers(self) -> list[str]:
        """Descriptions of state the schedule left unconsumed (empty after a complete step)."""
        found = []
        if self.train and self.acts:
            found.append("backward (B, or W after I) never ran for " +
                         ", ".join(f"stage {s} microbatch {m}" for s, m in sorted(self.acts)))
        if self.outbox:
            found.append("produced but never sent: " + ", ".join(
                f"{s}{op.value}{m}" for op, s, m in sorted(self.outbox, key=lambda k: (k[1], k[2]))))
        for name, table in (("activations", self.local_fwd), ("gradients", self.local_grad)):
            if table:
                found.append(f"local {name} never consumed: " +
                             ", ".join(f"stage {s} microbatch {m}" for s, m in sorted(table)))
        return found


def microbatch_rows(batch: int, num_microbatches: int) -> list[int]:
    """Rows per microbatch as torch.tensor_split deals them (the first batch % M get one more)."""
    base, extra = divmod(batch, num_microbatches)
    return [base + (1 if m < extra else 0) for m in range(num_microbatches)]


def split_batch(value: Any, num_microbatches: int, what: str) -> list[Any]:
    """Split a tensor or structure along dim 0 into M microbatches (sizes differ by at most one);
    ValueError naming the path when impossible."""
    return structure.split(value, num_microbatches, what)


def signature(inputs: Any, num_microbatches: int) -> int:
    """A 60-bit hash naming the microbatch inputs' forms, shapes and dtypes (equal on every rank): computed
    from the batch, since its form, shapes and dtypes and the number of microbatches determine them."""
    text = repr([structure.signature(inputs), num_microbatches])
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def forward_only(row: tuple[Action, ...]) -> tuple[Action, ...]:
    """One rank's list for evaluate(): its F actions (pairs give their F part) and F transfers."""
    keep = (Op.F, Op.RECV_F, Op.SEND_F)
    out: list[Action] = []
    for action in row:
        if action.op is Op.OVERLAP_F_B:
            out.extend(p for p in action.parts if p.op is Op.F)
        elif action.op in keep:
            out.append(action)
    return tuple(out)
