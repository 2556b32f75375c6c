"""One step of the interpreter on one rank (`Step`: its facts and all that lives only for it), and its helpers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from duplexpipe.runtime import structure
from duplexpipe.runtime.collectives import Agreement
from duplexpipe.runtime.comm_points import CommRecord
from duplexpipe.runtime.loss_sum import LossSum
from duplexpipe.runtime.memory import StepMemory
from duplexpipe.runtime.message_meta import Message
from duplexpipe.runtime.messages import Mailbox
from duplexpipe.runtime.offload import Offload
from duplexpipe.runtime.rankplan import RankPlan
from duplexpipe.runtime.stage_compute import Activations
from duplexpipe.runtime.timing import Tracer


@dataclass(eq=False)
class Step:
    """One step (or evaluation) of one rank: created when it starts, dropped when it ends or fails (nothing of it is
    reset or carried over). It owns everything that lives only for the step, each piece changed by whoever works
    on it: the mailbox (the Mailroom), the activations (the Dispatcher), the loss sum, the trace, the exchanges
    inside stage compute, the gradients set aside for the mirror sum. The runtime keeps what outlives steps
    (transport, watchdog, rank plan, shape cache)."""

    train: bool
    """True for step(), False for evaluate() (no autograd, F actions only)."""
    number: int
    """The step number (equal on every rank; names this step's shape announcements)."""
    agreement: Agreement
    """What the ranks agreed on at its start (batch rows, shape signature)."""
    plan: RankPlan
    """The list it runs (receives hoisted when the shapes are known)."""
    weights: list[float]
    """Microbatch m's share of the batch (rows_m / rows); its loss is scaled by it."""
    loss_scale: float
    """Extra factor on the loss before backward (gradients scale with it, the loss does not)."""
    inputs: dict[int, Message]
    """microbatch -> input rows (ranks holding a first stage)."""
    targets: dict[int, Any]
    """microbatch -> target rows (ranks holding a last stage), a tensor or a structure."""
    loss: LossSum | None
    """The step's loss sum (None: an evaluation without targets computes no loss)."""
    mail: Mailbox
    """Its messages on this rank (handoffs, outbox, metas)."""
    acts: Activations
    """What its forwards keep for their backwards, with the live counts and peaks."""
    trace: Tracer
    """Its compute events (time zero: its start)."""
    exchanges: list[CommRecord] = field(default_factory=list)
    """Its exchanges inside stage compute (MoE all-to-alls), for the timeline's "ep" lane."""
    outputs: dict[int, Any] = field(default_factory=dict)
    """evaluate() on a last stage: microbatch -> its output, detached."""
    set_aside: dict[int, list[Tensor | None]] = field(default_factory=dict)
    """DualPipe: the gradients mirrored stages held before the step (`MirrorSum.set_aside`), added back after."""
    memory: StepMemory | None = None
    """Its measured memory (RuntimeConfig.measure_memory, training steps only): sampled after every action."""
    offload: Offload | None = None
    """Its activation offload (PipelineRuntime.activation_offload, training steps only)."""

    @property
    def signature(self) -> int:
        """Hash of the microbatch input shapes (keys the activation-shape cache)."""
        return self.agreement.signature


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
