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
from duplexpipe.runtime.config import Residency
from duplexpipe.runtime.fb_pair import run_pair
from duplexpipe.runtime.message_meta import Message
from duplexpipe.runtime.messages import Mailroom
from duplexpipe.runtime.stage_compute import Activation, StageCompute
from duplexpipe.runtime.step import Step
from duplexpipe.runtime.structure import flatten, map_leaves
from duplexpipe.schedules.ir import Action, Op
from duplexpipe.schedules.layout import Layout

_KEEP_GRAD_MODE = contextlib.nullcontext()


def _gathered_first(wait: Callable[[int], None], run: Callable[[Step, Action], None], step: Step,
                    action: Action) -> None:
    """A compute action once its stages' parameters are gathered (ZeRO-3)."""
    for part in action.compute_parts():
        wait(part.stage)
    run(step, action)


def _on_stage(hook: Callable[[int], None], step: Step, action: Action) -> None:
    """A residency action: `hook(stage)`."""
    hook(action.stage)


def _grad_mode(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """torch.set_grad_enabled(enabled), or a shared no-op when autograd is already in that mode."""
    return _KEEP_GRAD_MODE if torch.is_grad_enabled() == enabled else torch.set_grad_enabled(enabled)


class Dispatcher:
    """What each action of one rank's list does, given the running `Step`: compute actions take their inputs from
    the step (a first stage's rows) or the Mailroom, run the stage (the step keeps what backward needs) and hand
    the results back to the Mailroom (the losses to the step's LossSum); transfer actions go to the Mailroom."""

    def __init__(self, layout: Layout, rank: int, stages: dict[int, StageCompute], mail: Mailroom,
                 loss_fn: Callable[[Any, Any], Tensor], driver: Driver | None = None,
                 fb_overlap: bool = False, device: torch.device | None = None) -> None:
        self.layout = layout
        self.rank = rank
        self.stages = stages
        self.mail = mail
        self.loss_fn = loss_fn
        self.driver = driver if driver is not None else Driver()
        """Runs the exchanges stages make inside their compute (MoE all-to-alls) outside a pair."""
        self.fb_overlap = fb_overlap
        """Run an OVERLAP_F_B pair's two parts interleaved at their comm points (`fb_pair.run_pair`)."""
        self.device = device if device is not None else torch.device("cpu")

    def handlers(self, residency: Residency | None = None) -> dict[Op, Callable[[Step, Action], None]]:
        """What each op of the list runs; with `residency`, also UNSHARD / RESHARD / REDUCE_GRAD, and every
        compute first waits for its stages' gathered parameters."""
        table: dict[Op, Callable[[Step, Action], None]] = {
            Op.F: self.forward, Op.B: self.backward, Op.I: self.backward, Op.W: self.weight,
            Op.OVERLAP_F_B: self.overlap, Op.SEND_F: self.send, Op.SEND_B: self.send,
            Op.RECV_F: self.expect_input, Op.RECV_B: self.expect_grads}
        if residency is None:
            return table
        for op in (Op.F, Op.B, Op.I, Op.W, Op.OVERLAP_F_B):
            table[op] = functools.partial(_gathered_first, residency.wait_unshard, table[op])
        table[Op.UNSHARD] = functools.partial(_on_stage, residency.unshard_stage)
        table[Op.RESHARD] = functools.partial(_on_stage, residency.reshard_stage)
        table[Op.REDUCE_GRAD] = functools.partial(_on_stage, residency.reduce_grad)
        return table

    # ---------------------------------------------------------------- the work itself
    def run_forward(self, step: Step, action: Action, message: Message) -> None:
        """F of (stage, microbatch) on `message`: keep what backward needs (counting its bytes when
        the stage has a meter, in parcels the step's offload moves when it has one), hand the output on or compute
        the loss."""
        stage, mb = action.stage, action.microbatch
        train = step.train
        compute = self.stages[stage]
        meter = compute.meter if train else None
        slot = CommSlot(current_driver(self.driver))
        offload = step.offload if train else None
        with _grad_mode(train), forward_slot(slot):
            if meter is None and offload is None:
                act, produced = self._forward(step, compute, mb, message)
            else:
                data = self._data(step, stage, mb, message)
                if meter is not None:
                    meter.start(data=data)
                hooks = (offload.saving(stage, mb, compute.module, data, meter.pack if meter is not None else None)
                         if offload is not None else meter.counting() if meter is not None else _KEEP_GRAD_MODE)
                with hooks:
                    act, produced = self._forward(step, compute, mb, message)
                if act is not None and meter is not None:
                    meter.keep(act.inputs)
                    act.saved_bytes, act.saved = meter.total, meter.storages
            if act is not None:
                act.slot = slot
                step.acts.hold(stage, mb, act)
            if produced is not None:
                self.mail.hand_on(step.mail, stage, mb, produced)

    def _data(self, step: Step, stage: int, mb: int, message: Message) -> list[Tensor]:
        """The caller's tensors a forward sees (a first stage's inputs, a last stage's targets): never
        counted as activations."""
        data = list(message.leaves) if self.layout.prv[stage] < 0 else []
        targets = step.targets
        if self.layout.nxt[stage] < 0 and mb in targets:
            data += flatten(targets[mb], "targets")[1]
        return data

    def _forward(self, step: Step, compute: StageCompute, mb: int,
                 message: Message) -> tuple[Activation | None, Message | None]:
        """The module (and the loss on a last stage): what to keep for backward (None outside
        training or without a loss) and the message to hand on (None on a last stage)."""
        train = step.train
        inputs, out = compute.forward(message, train)
        scale = step.weights[mb] * step.loss_scale
        extra = current_slot().losses
        if self.layout.nxt[compute.stage] >= 0:
            produced = compute.message(out, mb, train)
            if not train:
                return None, produced
            roots = [t for t, g in zip(produced.leaves, produced.grads, strict=True) if g]
            return compute.keep(inputs, roots, mb, extra=extra, extra_scale=scale), produced
        compute.message(out, mb, train=False)  # checks the structure
        if not train:
            step.outputs[mb] = map_leaves(Tensor.detach, out)
        loss_sum = step.loss
        if mb not in step.targets or loss_sum is None:
            return None, None
        loss = compute.loss(out, step.targets[mb], self.loss_fn, mb)
        loss_sum.add(loss.detach(), step.weights[mb])
        if not train:
            return None, None
        # backward starts from d(weight * scale * loss)/d(loss) = weight * scale (no extra multiply)
        return compute.keep(inputs, [loss], mb, scale, extra, scale), None

    def run_backward(self, step: Step, action: Action, grads: list[Tensor] | None) -> None:
        """B or I of (stage, microbatch) given its output gradients (None on a last stage)."""
        stage, mb = action.stage, action.microbatch
        compute = self.stages[stage]
        act = step.acts.pending(action)
        if step.offload is not None:
            step.offload.backward_starts(stage, mb)
        if act.slot is not None:  # the exchanges of its backward run on this code's driver
            act.slot.driver = current_driver(self.driver)
        if action.op is Op.B:
            dinputs = compute.backward(act, grads)
            step.acts.release(stage, mb, act)
        else:
            dinputs = compute.backward_input(act, grads)
        self.mail.hand_back(step.mail, stage, mb, dinputs)

    def _input(self, step: Step, stage: int, mb: int, consumer: Action) -> Message:
        """The message `stage` consumes for `mb`: the batch's rows on a first stage, else the Mailroom's."""
        if self.layout.prv[stage] >= 0:
            return self.mail.take_input(step.mail, stage, mb, consumer)
        message = step.inputs.get(mb)
        if message is None:
            raise PipelineError(f"rank {self.rank}: {consumer} has no input rows for microbatch {mb}")
        return message

    # ---------------------------------------------------------------- handlers
    def forward(self, step: Step, action: Action) -> None:
        """F."""
        message = self._input(step, action.stage, action.microbatch, action)
        trace = step.trace
        begin = trace.begin()
        self.run_forward(step, action, message)
        trace.end(action, begin)

    def backward(self, step: Step, action: Action) -> None:
        """B or I."""
        grads = self.mail.take_grads(step.mail, action.stage, action.microbatch, action)
        trace = step.trace
        begin = trace.begin()
        self.run_backward(step, action, grads)
        trace.end(action, begin)

    def weight(self, step: Step, action: Action) -> None:
        """W: the weight gradients its I deferred."""
        act = step.acts.pending(action)
        trace = step.trace
        begin = trace.begin()
        self.stages[action.stage].backward_weight(act)
        trace.end(action, begin)
        step.acts.release(action.stage, action.microbatch, act)

    def overlap(self, step: Step, action: Action) -> None:
        """OVERLAP_F_B: both parts' inputs first, then the two parts: interleaved at their comm points
        (`fb_overlap`: the backward's first piece goes first, its exchange hidden behind the forward's; a full
        B's deferrable weight gradients, moe.linear's projections, fill the waits), else the forward, then the
        backward."""
        fwd, bwd = action.parts
        message = self._input(step, fwd.stage, fwd.microbatch, action)
        grads = self.mail.take_grads(step.mail, bwd.stage, bwd.microbatch, action)
        with step.trace.span(action):
            if self.fb_overlap:
                run_pair(functools.partial(self.run_backward, step, bwd, grads),
                         functools.partial(self.run_forward, step, fwd, message), self.driver, self.device,
                         defer_weights=bwd.op is Op.B)
            else:
                self.run_forward(step, fwd, message)
                self.run_backward(step, bwd, grads)

    def send(self, step: Step, action: Action) -> None:
        """SEND_F / SEND_B."""
        self.mail.send(step.mail, action)

    def expect_input(self, step: Step, action: Action) -> None:
        """RECV_F."""
        self.mail.expect_input(step.mail, action)

    def expect_grads(self, step: Step, action: Action) -> None:
        """RECV_B."""
        self.mail.expect_grads(step.mail, action)
