"""Compute dispatch: what F, B, I, W and an OVERLAP_F_B pair do on one rank, given its messages."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from duplexpipe.errors import PipelineError
from duplexpipe.runtime.comm_points import BackwardMode, CommSlot, Driver, current_driver, current_slot, forward_slot
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
    """The compute handlers of one rank: each takes its inputs from the Mailroom, runs the stage
    and hands the results back to the Mailroom."""

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

    # ---------------------------------------------------------------- the work itself
    def run_forward(self, ctx: StepContext, action: Action, message: Message) -> None:
        """F of (stage, microbatch) on `message`: keep what backward needs (counting its bytes when
        the stage has a meter), hand the output on or compute the loss."""
        stage, mb = action.stage, action.microbatch
        meter = self.stages[stage].meter if ctx.train else None
        slot = CommSlot(current_driver(self.driver))
        with _grad_mode(ctx.train), forward_slot(slot):
            if meter is None:
                act, produced = self._forward(ctx, stage, mb, message)
            else:
                meter.start(data=self._data(ctx, stage, mb, message))
                with meter.counting():
                    act, produced = self._forward(ctx, stage, mb, message)
                if act is not None:
                    meter.keep(act.inputs)
                    act.saved_bytes = meter.total
            if act is not None:
                act.slot = slot
                ctx.acts[(stage, mb)] = act
                ctx.activation_born(act.saved_bytes)
            if produced is not None:
                self.mail.hand_on(ctx, stage, mb, produced)

    def _data(self, ctx: StepContext, stage: int, mb: int, message: Message) -> list[Tensor]:
        """The caller's tensors a forward sees (a first stage's inputs, a last stage's targets): never
        counted as activations."""
        data = list(message.leaves) if self.layout.prv[stage] < 0 else []
        if self.layout.nxt[stage] < 0 and mb in ctx.targets:
            data += flatten(ctx.targets[mb], "targets")[1]
        return data

    def _forward(self, ctx: StepContext, stage: int, mb: int, message: Message
                 ) -> tuple[Activation | None, Message | None]:
        """The module (and the loss on a last stage): what to keep for backward (None outside
        training or without a loss) and the message to hand on (None on a last stage)."""
        compute = self.stages[stage]
        inputs, out = compute.forward(message, mb, ctx.train)
        scale = ctx.weights[mb] * ctx.loss_scale
        extra = current_slot().losses
        if self.layout.nxt[stage] >= 0:
            produced = compute.message(out, mb, ctx.train)
            if not ctx.train:
                return None, produced
            roots = [t for t, g in zip(produced.leaves, produced.grads, strict=True) if g]
            return compute.keep(inputs, roots, mb, extra=extra, extra_scale=scale), produced
        compute.message(out, mb, train=False)  # checks the structure
        if not ctx.train:
            ctx.outputs[mb] = map_leaves(Tensor.detach, out)
        if mb not in ctx.targets:
            return None, None
        loss = compute.loss(out, ctx.targets[mb], self.loss_fn, mb)
        ctx.losses.append(loss.detach())
        ctx.loss_weights.append(ctx.weights[mb])
        if not ctx.train:
            return None, None
        # backward starts from d(weight * scale * loss)/d(loss) = weight * scale (no extra multiply)
        return compute.keep(inputs, [loss], mb, scale, extra, scale), None

    def run_backward(self, ctx: StepContext, action: Action, grads: list[Tensor] | None) -> None:
        """B or I of (stage, microbatch) given its output gradients (None on a last stage)."""
        stage, mb = action.stage, action.microbatch
        act = ctx.acts.get((stage, mb))
        if act is None or act.weight_work is not None:
            raise PipelineError(f"rank {self.rank}: {action} runs without a pending forward {stage}F{mb}")
        compute = self.stages[stage]
        if act.slot is not None:  # the exchanges of its backward run on this code's driver
            act.slot.driver = current_driver(self.driver)
            act.slot.backward = BackwardMode.ALL if action.op is Op.B else BackwardMode.INPUTS
        if action.op is Op.B:
            dinputs = compute.backward(act, grads)
            del ctx.acts[(stage, mb)]
            ctx.activation_freed(act.saved_bytes)
        else:
            dinputs = compute.backward_input(act, grads)
        self.mail.hand_back(ctx, stage, mb, dinputs)

    # ---------------------------------------------------------------- handlers
    def forward(self, ctx: StepContext, action: Action) -> None:
        """F."""
        message = self.mail.take_input(ctx, action.stage, action.microbatch, action)
        begin = self.tracer.begin()
        self.run_forward(ctx, action, message)
        self.tracer.end(action, begin)

    def backward(self, ctx: StepContext, action: Action) -> None:
        """B or I."""
        grads = self.mail.take_grads(ctx, action.stage, action.microbatch, action)
        begin = self.tracer.begin()
        self.run_backward(ctx, action, grads)
        self.tracer.end(action, begin)

    def weight(self, ctx: StepContext, action: Action) -> None:
        """W: the weight gradients its I deferred."""
        act = ctx.acts.get((action.stage, action.microbatch))
        if act is None or act.weight_work is None:
            raise PipelineError(f"rank {self.rank}: {action} runs without a pending "
                                f"{action.stage}I{action.microbatch}")
        if act.slot is not None:
            act.slot.backward = BackwardMode.WEIGHTS
        begin = self.tracer.begin()
        self.stages[action.stage].backward_weight(act, action.microbatch)
        self.tracer.end(action, begin)
        del ctx.acts[(action.stage, action.microbatch)]
        ctx.activation_freed(act.saved_bytes)

    def overlap(self, ctx: StepContext, action: Action) -> None:
        """OVERLAP_F_B: both parts' inputs first, then the two parts: interleaved at their comm points
        (`fb_overlap`: the backward's first piece goes first, its exchange hidden behind the forward's; a full
        B's deferrable weight gradients, moe.linear's projections, fill the waits), else the forward, then the
        backward."""
        fwd, bwd = action.parts
        message = self.mail.take_input(ctx, fwd.stage, fwd.microbatch, action)
        grads = self.mail.take_grads(ctx, bwd.stage, bwd.microbatch, action)
        with self.tracer.span(action):
            if self.fb_overlap:
                run_pair(functools.partial(self.run_backward, ctx, bwd, grads),
                         functools.partial(self.run_forward, ctx, fwd, message), self.driver, self.device,
                         defer_weights=bwd.op is Op.B)
            else:
                self.run_forward(ctx, fwd, message)
                self.run_backward(ctx, bwd, grads)
