"""Per-step facts of the interpreter (train flag, step number, weights, inputs and targets), and their helpers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from duplexpipe.runtime import structure
from duplexpipe.runtime.loss_sum import LossSum
from duplexpipe.runtime.message_meta import Message
from duplexpipe.schedules.ir import Action, Op


@dataclass(frozen=True)
class StepContext:
    """The facts of one step (or evaluation) of one rank that nothing else owns; dropped when the step ends.
    What changes during a step lives with whoever changes it: activations on their stage (`StageCompute`), the
    mailbox in the `Mailroom`, the losses in the step's `LossSum`."""

    train: bool
    """True for step(), False for evaluate() (no autograd, F actions only)."""
    step: int
    """The step number (equal on every rank; names this step's shape announcements)."""
    weights: list[float]
    """Microbatch m's share of the batch (rows_m / rows); its loss is scaled by it."""
    signature: int
    """Hash of the microbatch input shapes (keys the activation-shape cache)."""
    loss_scale: float
    """Extra factor on the loss before backward (gradients scale with it, the loss does not)."""
    inputs: dict[int, Message]
    """microbatch -> input rows (ranks holding a first stage)."""
    targets: dict[int, Any]
    """microbatch -> target rows (ranks holding a last stage), a tensor or a structure."""
    loss: LossSum | None
    """The step's loss sum (None: an evaluation without targets computes no loss)."""


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


def forward_only(actions: tuple[Action, ...]) -> tuple[Action, ...]:
    """One rank's list for evaluate(): its F actions (pairs give their F part) and F transfers."""
    keep = (Op.F, Op.RECV_F, Op.SEND_F)
    out: list[Action] = []
    for action in actions:
        if action.op is Op.OVERLAP_F_B:
            out.extend(p for p in action.parts if p.op is Op.F)
        elif action.op in keep:
            out.append(action)
    return tuple(out)
