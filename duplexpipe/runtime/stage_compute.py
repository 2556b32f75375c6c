"""Stage compute: forward (saving what backward needs), loss, full backward, I and W."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from duplexpipe.runtime.autograd_split import WeightWork, backward_input
from duplexpipe.runtime.watchdog import PipelineError


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of the one tensor that flows between two stages."""

    shape: tuple[int, ...]
    """The tensor's full shape (microbatch rows first)."""
    dtype: torch.dtype
    """Its dtype."""

    @staticmethod
    def of(tensor: Tensor) -> TensorMeta:
        """The meta of `tensor`."""
        return TensorMeta(tuple(tensor.shape), tensor.dtype)

    def __str__(self) -> str:
        return f"{self.shape} {str(self.dtype).replace('torch.', '')}"


@dataclass
class Activation:
    """What one (stage, microbatch) keeps from its forward until its backward is done.

    Only the input leaf (when its gradient is needed) and the gradient edge of the output
    (or the loss) are kept; the output tensor itself is dropped once it has been handed on,
    so sent outputs are freed when their send completes.
    """

    inp: Tensor | None
    """The stage input leaf when it requires grad (its gradient goes to the previous stage)."""
    root: GradientEdge
    """Where backward starts: the output's gradient edge, or the scaled loss's."""
    root_meta: TensorMeta
    """Shape and dtype of that output (the gradient to receive) or of the loss."""
    device: torch.device
    """The device of the output (for the loss's unit gradient)."""
    weight_work: WeightWork | None = None
    """Set by I: the deferred W."""


class StageCompute:
    """Runs one stage's module: forward, loss, backward (full or split into I and W)."""

    def __init__(self, stage: int, module: nn.Module, autocast_dtype: torch.dtype | None) -> None:
        self.stage = stage
        self.module = module
        self.autocast_dtype = autocast_dtype

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

    def forward(self, inp: Tensor, microbatch: int, train: bool) -> tuple[Tensor, Tensor]:
        """Run the module on `inp`; returns (input leaf, output). One Tensor must come out."""
        leaf = inp.detach()
        if train and leaf.is_floating_point():
            leaf.requires_grad_(True)
        with self._autocast(leaf.device):
            out = self.module(leaf)
        if not isinstance(out, Tensor):
            raise PipelineError(
                f"stage {self.stage} microbatch {microbatch}: the module returned {type(out).__name__}; "
                "exactly one Tensor flows between stages (pack several into one tensor)")
        return leaf, out

    def loss(self, out: Tensor, target: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor],
             microbatch: int) -> Tensor:
        """loss_fn(out, target): must be a scalar, the mean over the microbatch's samples."""
        with self._autocast(out.device):
            value = loss_fn(out, target)
        if not isinstance(value, Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"stage {self.stage} microbatch {microbatch}: loss_fn must return a scalar "
                             f"tensor (the mean over the microbatch), got {shape}")
        return value

    def keep(self, leaf: Tensor, root: Tensor, microbatch: int) -> Activation:
        """What backward will need from this forward (root: the output, or the scaled loss)."""
        if not root.requires_grad:
            raise PipelineError(
                f"stage {self.stage} microbatch {microbatch}: the output does not require grad, so "
                "no backward can run (is the module's output detached, or are all parameters frozen?)")
        kept = leaf if leaf.requires_grad else None
        return Activation(kept, get_gradient_edge(root), TensorMeta.of(root), root.device)

    def _root_grad(self, act: Activation, grad: Tensor | None) -> Tensor:
        if grad is not None:
            return grad
        return torch.ones(act.root_meta.shape, dtype=act.root_meta.dtype, device=act.device)

    def backward(self, act: Activation, grad: Tensor | None) -> Tensor | None:
        """B: full backward; accumulates weight gradients, returns d(input) (None on a first stage)."""
        torch.autograd.backward([act.root], [self._root_grad(act, grad)])
        if act.inp is None:
            return None
        dinput = act.inp.grad if act.inp.grad is not None else torch.zeros_like(act.inp)
        act.inp = None
        return dinput

    def backward_input(self, act: Activation, grad: Tensor | None) -> Tensor | None:
        """I: d(input) only; the weight gradients wait in `act.weight_work` for W."""
        inputs = [act.inp] if act.inp is not None else []
        dinputs, act.weight_work = backward_input([act.root], [self._root_grad(act, grad)], inputs,
                                                  self.params())
        if act.inp is None:
            return None
        dinput = dinputs[0] if dinputs[0] is not None else torch.zeros_like(act.inp)
        act.inp = None
        return dinput

    def backward_weight(self, act: Activation, microbatch: int) -> None:
        """W: the weight gradients deferred by I."""
        if act.weight_work is None:
            raise PipelineError(f"stage {self.stage} microbatch {microbatch}: W ran before its I")
        act.weight_work.run()
        act.weight_work = None
