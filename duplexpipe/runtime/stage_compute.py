"""Stage compute: forward (keeping what backward needs per microbatch), loss, full backward, I and W, on structures."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from duplexpipe.comm.codec import TensorSpec
from duplexpipe.errors import ActivationShapeError, PipelineError, StructureError
from duplexpipe.runtime.backward.graph import ParamGroups, stage_backward_input, stage_backward_weight
from duplexpipe.runtime.comm_points import CommSlot
from duplexpipe.runtime.message_meta import Message
from duplexpipe.runtime.saved_bytes import SavedBytes
from duplexpipe.runtime.structure import call, flatten
from duplexpipe.schedules.ir import Action, Op

LOG = logging.getLogger("duplexpipe.compile")


@dataclass
class Activation:
    """What one (stage, microbatch) keeps from its forward until its backward is done.

    Only the input leaves whose gradients go back and the gradient edges of the outputs that
    carry gradients (or of the loss) are kept; the outputs themselves are dropped once handed
    on, so sent outputs are freed when their sends complete.
    """

    inputs: list[Tensor]
    """The input leaves that require grad (their gradients go to the previous stage), in leaf order."""
    roots: list[GradientEdge]
    """Where backward starts: the gradient-carrying outputs' edges, or the scaled loss's."""
    root_metas: list[TensorSpec]
    """Shape and dtype of each root (the gradients to receive), or of the loss."""
    device: torch.device
    """The device of the outputs (for the loss's gradient)."""
    scale: float = 1.0
    """The gradient backward starts the loss with (its microbatch weight times the loss scale)."""
    weight_work: ParamGroups | None = None
    """Set by I: the deferred W."""
    saved_bytes: int = 0
    """What its forward keeps for backward (`SavedBytes`); 0 when not counted."""
    saved: dict[int, int] | None = None
    """The same per storage, address -> bytes (`SavedBytes.storages`); None when not counted."""
    extra: int = 0
    """How many of the last `roots` are loss terms layers added (`CommSlot.losses`), not outputs."""
    extra_scale: float = 1.0
    """The gradient backward starts those terms with (the microbatch's loss weight times the loss scale)."""
    slot: CommSlot | None = None
    """The comm slot its forward's exchanges captured (MoE layers): pointed at the driver of its backward."""


class Activations:
    """What one rank's stages keep for backward during one step, per (stage, microbatch): how many (and how many
    bytes) are live now, and the most at once. Held by the step, so a new step (or a failed one) starts empty."""

    __slots__ = ("rank", "held", "live", "peak", "live_bytes", "peak_bytes")

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.held: dict[tuple[int, int], Activation] = {}
        """(stage, microbatch) -> what its backward needs, from its F until its B or W."""
        self.live = self.peak = self.live_bytes = self.peak_bytes = 0

    def hold(self, stage: int, microbatch: int, act: Activation) -> None:
        """Keep what `microbatch`'s backward on `stage` needs (counted live until `release`)."""
        self.held[(stage, microbatch)] = act
        self.live += 1
        self.live_bytes += act.saved_bytes
        if self.live > self.peak:
            self.peak = self.live
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def pending(self, action: Action) -> Activation:
        """What `action` (B, I or W) runs on: a forward without its I for B and I, one after its I for W;
        PipelineError naming the action otherwise."""
        act = self.held.get((action.stage, action.microbatch))
        weights = action.op is Op.W
        if act is None or (act.weight_work is not None) != weights:
            before = f"{action.stage}I{action.microbatch}" if weights else f"forward {action.stage}F{action.microbatch}"
            raise PipelineError(f"rank {self.rank}: {action} runs without a pending {before}")
        return act

    def release(self, stage: int, microbatch: int, act: Activation) -> None:
        """`microbatch`'s backward on `stage` is done: drop what it kept."""
        del self.held[(stage, microbatch)]
        self.live -= 1
        self.live_bytes -= act.saved_bytes

    def left(self) -> list[str]:
        """What the step left unconsumed: activations whose backward never ran (empty after a step)."""
        if not self.held:
            return []
        return ["backward (B, or W after I) never ran for " +
                ", ".join(f"stage {s} microbatch {m}" for s, m in sorted(self.held))]


class StageCompute:
    """Runs one stage's module: forward, loss, backward (full or split into I and W); keeps, per microbatch, what
    each training forward left for its backward (torch pipelining's style), and each evaluation output."""

    def __init__(self, stage: int, module: nn.Module, autocast_dtype: torch.dtype | None,
                 count_saved: bool = False, part: int | None = None) -> None:
        self.stage = stage
        self.module = module
        self.name = f"stage {stage}" + (f" (model part {part})" if part is not None else "")
        """How errors name this stage."""
        self.autocast_dtype = autocast_dtype
        self.meter = SavedBytes(module.parameters(), live=module.parameters) if count_saved else None
        """Counts what each training forward keeps for backward (None: not counted)."""
        self.noted_whole_regions = False
        """Whether the log has said that this stage's compiled regions run their backward whole at I."""

    def params(self) -> list[Tensor]:
        """The module's parameters that take gradients."""
        return [p for p in self.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def _autocast(self, device: torch.device) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=device.type, dtype=self.autocast_dtype):
            yield

    def forward(self, message: Message, train: bool) -> tuple[list[Tensor], Any]:
        """Run the module on the message (a tuple/list as positional arguments, a dict as keyword
        arguments, or whole: `structure.call`); returns (the input leaves that require grad, the output)."""
        leaves = [t.detach() for t in message.leaves]
        wanted = []
        if train:
            for leaf, grad in zip(leaves, message.grads, strict=True):
                if grad:
                    wanted.append(leaf.requires_grad_(True))
        if self.autocast_dtype is None:
            return wanted, call(self.module, message.form, leaves, self.name)
        with self._autocast(leaves[0].device):
            out = call(self.module, message.form, leaves, self.name)
        return wanted, out

    def message(self, out: Any, microbatch: int, train: bool) -> Message:
        """The output as a Message; PipelineError naming the path of a leaf that is not a tensor."""
        try:
            form, leaves = flatten(out, "out")
        except StructureError as exc:
            raise PipelineError(f"stage {self.stage} microbatch {microbatch}: the module's output {exc}") from None
        return Message(form, leaves, tuple(train and t.requires_grad for t in leaves))

    def loss(self, out: Any, target: Any, loss_fn: Callable[[Any, Any], Tensor], microbatch: int) -> Tensor:
        """loss_fn(out, target): must be a scalar, the mean over the microbatch's samples; the output's rows (dimension
        0 of its first tensor) must be the targets' (else a stage changed the batch size and the loss would
        broadcast)."""
        self._check_rows(out, target, microbatch)
        if self.autocast_dtype is None:
            value = loss_fn(out, target)
        else:
            with self._autocast(flatten(out, "out")[1][0].device):
                value = loss_fn(out, target)
        if not isinstance(value, Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"stage {self.stage} microbatch {microbatch}: loss_fn must return a scalar "
                             f"tensor (the mean over the microbatch), got {shape}")
        return value

    def _check_rows(self, out: Any, target: Any, microbatch: int) -> None:
        """ActivationShapeError when the loss input and the targets have different batch sizes (dimension 0);
        PipelineError naming the stage when the last stage returned None."""
        if out is None:
            raise PipelineError(f"stage {self.stage} microbatch {microbatch}: the module's output is NoneType; "
                                "expected a tensor, or tuples/lists/dicts of tensors, for the loss")
        got, want = _rows(out), _rows(target)
        if got is not None and want is not None and got != want:
            raise ActivationShapeError(
                f"stage {self.stage} microbatch {microbatch}: the loss input (this last stage's output) has {got} rows "
                f"but its targets have {want}: a stage changed the batch size; every stage must keep the "
                "microbatch's samples in dimension 0 (reshape inside loss_fn instead)")

    def keep(self, inputs: list[Tensor], roots: list[Tensor], microbatch: int, scale: float = 1.0,
             extra: Sequence[Tensor] = (), extra_scale: float = 1.0) -> Activation:
        """What backward will need from this forward (roots: the gradient-carrying outputs, or the loss,
        whose gradient backward starts from `scale`: the same as a loss multiplied by it). `extra`: scalar
        loss terms layers added to the objective (`CommSlot.losses`), started from `extra_scale`."""
        if not roots:
            raise PipelineError(
                f"stage {self.stage} microbatch {microbatch}: the output does not require grad, so "
                "no backward can run (is the module's output detached, or are all parameters frozen?)")
        terms = [t for t in extra if t.requires_grad]
        every = list(roots) + terms
        return Activation(list(inputs), [get_gradient_edge(r) for r in every], [TensorSpec.of(r) for r in every],
                          roots[0].device, scale, extra=len(terms), extra_scale=extra_scale)

    def _root_grads(self, act: Activation, grads: list[Tensor] | None) -> list[Tensor]:
        if grads is None:
            return [torch.full(m.shape, act.scale, dtype=m.dtype, device=act.device) for m in act.root_metas]
        if not act.extra:
            return grads
        return list(grads) + [torch.full(m.shape, act.extra_scale, dtype=m.dtype, device=act.device)
                              for m in act.root_metas[-act.extra:]]

    def backward(self, act: Activation, grads: list[Tensor] | None) -> list[Tensor]:
        """B: full backward; accumulates weight gradients, returns d(input) per kept input leaf
        (zeros where an input did not reach the outputs)."""
        torch.autograd.backward(act.roots, self._root_grads(act, grads))
        out = [t.grad if t.grad is not None else torch.zeros_like(t) for t in act.inputs]
        act.inputs = []
        return out

    def backward_input(self, act: Activation, grads: list[Tensor] | None) -> list[Tensor]:
        """I: d(input) only; the weight gradients wait in `act.weight_work` for W."""
        found, act.weight_work = stage_backward_input(act.roots, self._root_grads(act, grads), act.inputs,
                                                      self.params())
        if act.weight_work.computed_at_input and not self.noted_whole_regions:
            self.noted_whole_regions = True
            LOG.info("%s: %d parameters sit in compiled regions whose backward is one graph (compiled outside "
                     "PipelineConfig.compile): their gradients are computed at I and handed to W",
                     self.name, act.weight_work.computed_at_input)
        out = [g if g is not None else torch.zeros_like(t) for g, t in zip(found, act.inputs, strict=True)]
        act.inputs = []
        return out

    def backward_weight(self, act: Activation) -> None:
        """W: the weight gradients deferred by I (`Activations.pending` checked that I ran)."""
        work, act.weight_work = act.weight_work, None
        if work is not None:
            stage_backward_weight(work)


def _rows(value: Any) -> int | None:
    """Dimension 0 of the first tensor of a structure with one (None for a scalar or no tensor)."""
    if isinstance(value, Tensor):
        return int(value.shape[0]) if value.dim() else None
    try:
        leaves = flatten(value, "value")[1]
    except StructureError:
        return None
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() else None
