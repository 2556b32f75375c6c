"""Compute dispatch: what F, B, I, W and an OVERLAP_F_B pair do on one rank, given its messages."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from duplexpipe.errors import PipelineError
from duplexpipe.runtime.comm_points import CommSlot, Driver, current_driver, current_slot, forward_slot
from duplexpipe.runtime.context import StepContext
from duplexpipe.runtime.fb_pair import run_pair
from duplexpipe.runtime.message_meta import Message
from duplexpipe.runtime.messages import Mailroom
from duplexpipe.runtime.stage_compute import Activation, StageCompute
from duplexpipe.runtime.structure import flatten, map_leaves
from duplexpipe.runtime.timing import Tracer
from duplexpipe.schedules.ir import Action, Op
from duplexpipe.schedules.layout import Layout

_KEEP_GRAD_MODE = contextlib.nullcontext()


def _grad_mode(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """torch.set_grad_enabled(enabled), or a shared no-op when autograd is already in that mode."""
    return _KEEP_GRAD_MODE if torch.is_grad_enabled() == enabled else torch.set_grad_enabled(enabled)


class Dispatcher:
    """The compute handlers of one rank: each takes its inputs from the step (a first stage's rows) or the
    Mailroom, runs the stage (which keeps what backward needs) and hands the results back to the Mailroom (the
    losses to the step's LossSum)."""

    def __init__(self, layout: Layout, rank: int, stages: dict[int, StageCompute], mail: Mailroom,
                 loss_fn: Callable[[Any, Any], Tensor], tracer: Tracer, driver: Driver | None = None,
                 fb_overlap: bool = False, device: torch.device | None = None) -> None:
        self.layout = layout
        self.rank = rank
        self.stages = stages
        self.mail = mail
        self.loss_fn = loss_fn
        self.tracer = tracer
        self.driver = driver if driver is not None else Driver()
        """Runs the exchanges stages make inside their compute (MoE all-to-alls) outside a pair."""
        self.fb_overlap = fb_overlap
        """Run an OVERLAP_F_B pair's two parts interleaved at their comm points (`fb_pair.run_pair`)."""
        self.device = device if device is not None else torch.device("cpu")
        self.ctx: StepContext
        """The step running (set by `begin`)."""

    def begin(self, ctx: StepContext) -> None:
        """Run the handlers for step `ctx` from now on."""
        self.ctx = ctx

    # ---------------------------------------------------------------- the work itself
    def run_forward(self, action: Action, message: Message) -> None:
        """F of (stage, microbatch) on `message`: keep what backward needs (counting its bytes when
        the stage has a meter), hand the output on or compute the loss."""
        stage, mb = action.stage, action.microbatch
        train = self.ctx.train
        compute = self.stages[stage]
        meter = compute.meter if train else None
        slot = CommSlot(current_driver(self.driver))
        with _grad_mode(train), forward_slot(slot):
            if meter is None:
                act, produced = self._forward(compute, mb, message)
            else:
                meter.start(data=self._data(stage, mb, message))
                with meter.counting():
                    act, produced = self._forward(compute, mb, message)
                if act is not None:
                    meter.keep(act.inputs)
                    act.saved_bytes = meter.total
            if act is not None:
                act.slot = slot
                compute.hold(mb, act)
            if produced is not None:
                self.mail.hand_on(stage, mb, produced)

    def _data(self, stage: int, mb: int, message: Message) -> list[Tensor]:
        """The caller's tensors a forward sees (a first stage's inputs, a last stage's targets): never
        counted as activations."""
        data = list(message.leaves) if self.layout.prv[stage] < 0 else []
        targets = self.ctx.targets
        if self.layout.nxt[stage] < 0 and mb in targets:
            data += flatten(targets[mb], "targets")[1]
        return data

    def _forward(self, compute: StageCompute, mb: int, message: Message) -> tuple[Activation | None, Message | None]:
        """The module (and the loss on a last stage): what to keep for backward (None outside
        training or without a loss) and the message to hand on (None on a last stage)."""
        ctx = self.ctx
        inputs, out = compute.forward(message, mb, ctx.train)
        scale = ctx.weights[mb] * ctx.loss_scale
        extra = current_slot().losses
        if self.layout.nxt[compute.stage] >= 0:
            produced = compute.message(out, mb, ctx.train)
            if not ctx.train:
                return None, produced
            roots = [t for t, g in zip(produced.leaves, produced.grads, strict=True) if g]
            return compute.keep(inputs, roots, mb, extra=extra, extra_scale=scale), produced
        compute.message(out, mb, train=False)  # checks the structure
        if not ctx.train:
            compute.keep_output(mb, map_leaves(Tensor.detach, out))
        if mb not in ctx.targets or ctx.loss is None:
            return None, None
        loss = compute.loss(out, ctx.targets[mb], self.loss_fn, mb)
        ctx.loss.add(loss.detach(), ctx.weights[mb])
        if not ctx.train:
            return None, None
        # backward starts from d(weight * scale * loss)/d(loss) = weight * scale (no extra multiply)
        return compute.keep(inputs, [loss], mb, scale, extra, scale), None

    def run_backward(self, action: Action, grads: list[Tensor] | None) -> None:
        """B or I of (stage, microbatch) given its output gradients (None on a last stage)."""
        stage, mb = action.stage, action.microbatch
        compute = self.stages[stage]
        act = compute.acts.get(mb)
        if act is None or act.weight_work is not None:
            raise PipelineError(f"rank {self.rank}: {action} runs without a pending forward {stage}F{mb}")
        if act.slot is not None:  # the exchanges of its backward run on this code's driver
            act.slot.driver = current_driver(self.driver)
        if action.op is Op.B:
            dinputs = compute.backward(act, grads)
            compute.release(mb, act)
        else:
            dinputs = compute.backward_input(act, grads)
        self.mail.hand_back(stage, mb, dinputs)

    def _input(self, stage: int, mb: int, consumer: Action) -> Message:
        """The message `stage` consumes for `mb`: the batch's rows on a first stage, else the Mailroom's."""
        if self.layout.prv[stage] >= 0:
            return self.mail.take_input(stage, mb, consumer)
        message = self.ctx.inputs.get(mb)
        if message is None:
            raise PipelineError(f"rank {self.rank}: {consumer} has no input rows for microbatch {mb}")
        return message

    # ---------------------------------------------------------------- handlers
    def forward(self, action: Action) -> None:
        """F."""
        message = self._input(action.stage, action.microbatch, action)
        begin = self.tracer.begin()
        self.run_forward(action, message)
        self.tracer.end(action, begin)

    def backward(self, action: Action) -> None:
        """B or I."""
        grads = self.mail.take_grads(action.stage, action.microbatch, action)
        begin = self.tracer.begin()
        self.run_backward(action, grads)
        self.tracer.end(action, begin)

    def weight(self, action: Action) -> None:
        """W: the weight gradients its I deferred."""
        compute = self.stages[action.stage]
        act = compute.acts.get(action.microbatch)
        if act is None or act.weight_work is None:
            raise PipelineError(f"rank {self.rank}: {action} runs without a pending "
                                f"{action.stage}I{action.microbatch}")
        begin = self.tracer.begin()
        compute.backward_weight(act, action.microbatch)
        self.tracer.end(action, begin)
        compute.release(action.microbatch, act)

    def overlap(self, action: Action) -> None:
        """OVERLAP_F_B: both parts' inputs first, then the two parts: interleaved at their comm points
        (`fb_overlap`: the backward's first piece goes first, its exchange hidden behind the forward's; a full
        B's deferrable weight gradients, moe.linear's projections, fill the waits), else the forward, then the
        backward."""
        fwd, bwd = action.parts
        message = self._input(fwd.stage, fwd.microbatch, action)
        grads = self.mail.take_grads(bwd.stage, bwd.microbatch, action)
        with self.tracer.span(action):
            if self.fb_overlap:
                run_pair(functools.partial(self.run_backward, bwd, grads),
                         functools.partial(self.run_forward, fwd, message), self.driver, self.device,
                         defer_weights=bwd.op is Op.B)
            else:
                self.run_forward(fwd, message)
                self.run_backward(bwd, grads)
