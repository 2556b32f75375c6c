"""A Linear whose weight gradient an F&B pair may form later, to fill its waits for the exchanges in flight.

In an F&B pair the forward's pieces are shorter than the backward's exchanges they must hide (a backward costs
about twice its forward). DeepSeek's answer is to form the backward's weight gradients where the pair would
otherwise wait: `linear(x, layer, slot)` runs `layer(x)`, and its backward forms d(input) at once and hands the
weight gradient to `slot.driver.defer`, which inside a pair's full backward keeps it for the pair's waits
(`runtime.fb_pair.run_pair`) and elsewhere declines it: it is then formed at once, by the same operations, so
the results are bit-equal either way. Under a split backward the Function reads its node's mark
(`runtime.backward.mode`, as compiled regions do): its I computes only d(input), its W the weights (and d(input)
only where the engine still runs the input's node).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from duplexpipe.runtime.backward.graph import accumulate
from duplexpipe.runtime.backward.mode import BackwardMode, input_wanted, take_mode
from duplexpipe.runtime.comm_points import CommSlot


class _Linear(torch.autograd.Function):
    """y = x @ w.T (+ b) over the rows of 2-D x, with the weight gradient deferrable."""

    splits_backward = True
    """Its backward reads its node's mark (`runtime.backward.mode.SPLITS_BACKWARD`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, slot: CommSlot) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.slot, ctx.bias, ctx.x_node = slot, bias, x.grad_fn
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        slot: CommSlot = ctx.slot
        mode = take_mode(ctx)  # the node: ctx is the autograd node of a Function
        grad_x = grad.mm(weight) if ctx.needs_input_grad[0] and input_wanted(mode, ctx.x_node) else None
        wanted = (ctx.needs_input_grad[1], ctx.bias is not None and ctx.needs_input_grad[2])
        if mode is BackwardMode.INPUTS or not any(wanted):
            return grad_x, None, None, None
        params = (weight, ctx.bias)
        if slot.driver.defer(lambda: accumulate(params, _computed(wanted, grad, x))):
            return grad_x, None, None, None
        return (grad_x, *_computed(wanted, grad, x), None)


def _computed(wanted: tuple[bool, bool], grad: Tensor, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The weight and bias gradients (None where not wanted)."""
    return (grad.t().mm(x) if wanted[0] else None, grad.sum(0) if wanted[1] else None)


def linear(x: Tensor, layer: nn.Linear, slot: CommSlot) -> Tensor:
    """layer(x) with a weight gradient `slot`'s F&B pair may form later (any leading dimensions; under
    autocast, without autograd, or with a tensor-parallel (DTensor) weight, the Linear itself: DTensor's autograd
    forms the gradients of a sharded projection, at once)."""
    if (not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type) or not layer.weight.requires_grad
            or isinstance(layer.weight, DTensor)):
        return layer(x)
    out: Tensor = _Linear.apply(x.reshape(-1, x.shape[-1]), layer.weight, layer.bias, slot)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])  # 2-D: no view (FSDP hooks it)
