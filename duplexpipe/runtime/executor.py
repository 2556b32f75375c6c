"""PipelineRuntime: a thin interpreter running one rank's instruction list over torch.distributed."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from duplexpipe.runtime.collectives import BatchAgreement, MirrorSum, PendingSum, agree, share_blocks
from duplexpipe.runtime.context import (
    Slot,
    StepContext,
    forward_only,
    microbatch_rows,
    signature,
    split_batch,
)
from duplexpipe.runtime.handshake import group_store, handshake
from duplexpipe.runtime.options import EvalResult, RuntimeConfig, StepResult
from duplexpipe.runtime.stage_compute import StageCompute, TensorMeta
from duplexpipe.runtime.timing import Tracer
from duplexpipe.runtime.transport import MetaBoard, Transport
from duplexpipe.runtime.watchdog import ActivationShapeError, PeerFailedError, PipelineError, Watchdog
from duplexpipe.schedules.ir import Action, Op, Schedule

Handler = Callable[[StepContext, Action], None]
SHAPE_CACHE_SIZE = 8
"""How many distinct input-shape signatures keep their learned activation shapes."""


def default_overlap(pair: Action, run_forward: Callable[[], None], run_backward: Callable[[], None]) -> None:
    """The default OVERLAP_F_B: the forward part, then the backward part."""
    run_forward()
    run_backward()


def _default_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PipelineRuntime:
    """Executes this rank's list of a (lowered) Schedule: one step = one pass over the list.

    One tensor flows between consecutive stages: each stage module takes one Tensor and
    returns one Tensor (the first stage may take integer token ids; later activations must be
    floating point to carry gradients). A stage's output shape must depend only on its input
    shape: shapes are announced through the c10d store on the first step and again whenever
    the batch's shapes change, and checked against the announcement otherwise
    (ActivationShapeError). `loss_fn(output, target)` must return the mean over the
    microbatch's samples; microbatch losses are weighted by their share of the batch rows, so
    uneven splits give the gradients of the mean loss over the whole batch.

    `modules` maps each stage this rank runs (schedule.stages_of_rank) to its module, already
    on `device`. Inputs are needed on ranks holding a first stage, targets on ranks holding a
    last stage (DualPipe: ranks 0 and P-1 hold both; V schedules: rank 0 holds both).
    A compute-only schedule is lowered first. Construction is collective: every rank of
    `group` checks that all run the same schedule (HandshakeError otherwise).
    """

    def __init__(self, schedule: Schedule, modules: Mapping[int, nn.Module],
                 loss_fn: Callable[[Tensor, Tensor], Tensor], *, group: Any = None,
                 device: torch.device | None = None, config: RuntimeConfig | None = None) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a duplexpipe Schedule, got {type(schedule).__name__}")
        if not schedule.has_comms and schedule.num_ranks > 1:
            from duplexpipe.schedules.lower import lower
            schedule = lower(schedule)
        self.schedule = schedule
        self.config = config if config is not None else RuntimeConfig()
        self.group = group
        self.rank = dist.get_rank(group)
        self.device = torch.device(device) if device is not None else _default_device(group)
        self.loss_fn = loss_fn
        self.modules = dict(modules)
        bad = {s: type(m).__name__ for s, m in self.modules.items() if not isinstance(m, nn.Module)}
        nonce = handshake(schedule, self.modules, group, self.device, self.config.timeout_s,
                          f"rank {self.rank}: modules must be nn.Module, got {bad}" if bad else "")
        if "nccl" in str(dist.get_backend(group)):  # one stream per rank pair: ScheduleError, not a hang
            from duplexpipe.schedules.verify import check_nccl_order
            check_nccl_order(schedule)
            if not self.config.prefetch:
                raise ValueError("RuntimeConfig.prefetch=False is for gloo only: on NCCL a receive posted at "
                                 "its consumer can deadlock against the sends posted before it")
        prefix = f"duplexpipe/{nonce}"
        store = group_store(group)
        if store is None:
            raise PipelineError("no c10d store is reachable for the process group: the runtime needs it "
                                "for shape announcements and the shared error flag")
        self.watchdog = Watchdog(store, prefix, self.rank, self.config.timeout_s,
                                 self.config.poll_interval_s, threaded_p2p=self.device.type == "cpu")
        self.transport = Transport(group, self.device, self.watchdog, prefetch=self.config.prefetch)
        self.board = MetaBoard(store, prefix, self.watchdog)
        self.tracer = Tracer(self.rank, self.device, self.config.record_timeline)
        self.stages = {s: StageCompute(s, m, self.config.autocast_dtype) for s, m in self.modules.items()}
        global_ranks = [self.transport.global_rank(r) for r in range(schedule.num_ranks)]
        self.mirror = (MirrorSum(schedule, self.rank, self.modules, group, global_ranks, self.watchdog)
                       if self.config.sum_mirrored_grads and schedule.num_copies > 1 else None)
        self._global_ranks = global_ranks
        self._rows = schedule.actions[self.rank]
        self._eval_rows = forward_only(self._rows)
        self._firsts = [s for s in self.modules if schedule.is_first(s)]
        self._lasts = [s for s in self.modules if schedule.is_last(s)]
        self._shapes: OrderedDict[int, dict[Slot, TensorMeta]] = OrderedDict()
        self._step_no = 0
        self._broken: str | None = None
        self.batches = BatchAgreement(self.config.check_inputs_every_step, self.rank, bool(self._lasts))
        self._pending: PendingSum | None = None
        """The latest step's loss all-reduce until something waited for it."""
        self._handlers: dict[Op, Handler] = {
            Op.F: self._forward, Op.B: self._backward, Op.I: self._backward, Op.W: self._weight,
            Op.OVERLAP_F_B: self._overlap, Op.SEND_F: self._send, Op.SEND_B: self._send,
            Op.RECV_F: self._recv, Op.RECV_B: self._recv,
        }

    # ---------------------------------------------------------------- public API
    def step(self, inputs: Tensor | None, targets: Tensor | None, *, loss_scale: float = 1.0) -> StepResult:
        """One training step over the whole batch (split into the schedule's microbatches).

        Gradients accumulate into .grad (never zeroed here) and equal those of
        loss_scale * (mean loss over the batch). Returns the mean loss on every rank; its
        all-reduce completes in the background (reading StepResult.loss, or the next call,
        waits for it).
        """
        ctx = self._begin(inputs, targets, train=True, loss_scale=loss_scale)
        pending = self._pending = self._run(ctx, self._rows)
        timeline = self.tracer.timeline(self.schedule.name, self.schedule.num_ranks,
                                        self.schedule.num_microbatches)
        loss = (lambda: self._read(pending)) if pending is not None else 0.0
        return StepResult(loss=loss, timeline=timeline, peak_activations=ctx.peak)

    def evaluate(self, inputs: Tensor | None, targets: Tensor | None = None) -> EvalResult:
        """Forward only (the schedule's F actions in order, no autograd).

        Returns the outputs for the whole batch in batch order on ranks holding a last
        stage (None elsewhere) and, when targets were given, the mean loss on every rank.
        """
        ctx = self._begin(inputs, targets, train=False, loss_scale=1.0)
        with torch.no_grad():
            pending = self._run(ctx, self._eval_rows)
            loss = self._read(pending) if pending is not None else None
            try:
                outputs = self._gather_outputs(ctx) if self._lasts else None
            except BaseException as exc:
                self._fail(exc, None)
                raise
        timeline = self.tracer.timeline(self.schedule.name, self.schedule.num_ranks,
                                        self.schedule.num_microbatches)
        return EvalResult(outputs=outputs, loss=loss, timeline=timeline)

    # ---------------------------------------------------------------- step frame
    def _check_inputs(self, inputs: Any, targets: Any, train: bool) -> tuple[list[Tensor], list[Tensor], str]:
        m = self.schedule.num_microbatches
        chunks: list[Tensor] = []
        target_chunks: list[Tensor] = []
        try:
            if self._firsts:
                if inputs is None:
                    raise ValueError(f"rank {self.rank} holds first stage(s) {self._firsts}: "
                                     "inputs are required")
                chunks = split_batch(inputs, m, "inputs")
            if self._lasts and targets is not None:
                target_chunks = split_batch(targets, m, "targets")
            elif self._lasts and train:
                raise ValueError(f"rank {self.rank} holds last stage(s) {self._lasts}: targets are required")
        except ValueError as exc:
            return [], [], str(exc)
        return chunks, target_chunks, ""

    def _begin(self, inputs: Any, targets: Any, train: bool, loss_scale: float) -> StepContext:
        if self._broken is not None:
            raise PipelineError(f"rank {self.rank}: this PipelineRuntime stopped after an error "
                                f"({self._broken}); build a new one")
        pending, self._pending = self._pending, None
        if pending is not None:
            self._read(pending)
        chunks, target_chunks, error = self._check_inputs(inputs, targets, train)
        rows = targets.shape[0] if target_chunks else (-1 if self._lasts else None)
        try:  # a mismatch with a kept agreement stops every rank: the others cannot see it
            kept = self.batches.reuse(inputs, targets, error) if train else None
            found = kept or agree(inputs.shape[0] if chunks else None, signature(chunks) if chunks else None,
                                  rows, bool(error), self.group, self.device, self.watchdog)
        except BaseException as exc:
            self._fail(exc, None)
            raise
        if kept is None:  # bad batches raise ValueError on every rank alike; the runtime stays usable
            self.batches.accept(found, error, train, inputs if chunks else None)
        self._step_no += 1
        cached = self._shapes.get(found.signature)
        num_mb = self.schedule.num_microbatches
        ctx = StepContext(train=train, step=self._step_no, learning=cached is None,
                          shapes=dict(cached) if cached is not None else {},
                          weights=[r / found.batch for r in microbatch_rows(found.batch, num_mb)],
                          signature=found.signature, has_targets=found.target_rows >= 0,
                          loss_scale=float(loss_scale))
        ctx.inputs = {mb: c.to(self.device) for mb, c in enumerate(chunks)}
        ctx.targets = {mb: c.to(self.device) for mb, c in enumerate(target_chunks)}
        if train and self.mirror is not None:
            self.mirror.begin()
        self.tracer.start()
        return ctx

    def _read(self, pending: PendingSum) -> float:
        """Wait for a loss all-reduce; a failure stops the runtime like a failed step."""
        try:
            return pending.value()
        except BaseException as exc:
            if self._broken is None:
                self._fail(exc, None)
            raise

    def _run(self, ctx: StepContext, rows: tuple[Action, ...]) -> PendingSum | None:
        action: Action | None = None
        try:
            for action in rows:
                self._handlers[action.op](ctx, action)
                self.transport.reap()
            action = None
            self.transport.finish()
            left = ctx.leftovers()
            if left:
                raise PipelineError(f"rank {self.rank}: the schedule left work undone: " + "; ".join(left))
            if ctx.train and self.mirror is not None:
                self.mirror.finish()
            loss = None
            if ctx.train or ctx.has_targets:  # posted now, waited for when read (every rank posts it)
                local = (torch.stack(ctx.losses).sum() if ctx.losses
                         else torch.zeros((), dtype=torch.float64, device=self.device))
                loss = PendingSum(local, self.group, self.device, self.watchdog, "the loss all-reduce")
        except BaseException as exc:
            self._fail(exc, action)
            raise
        if ctx.learning:
            self._shapes[ctx.signature] = ctx.shapes
            while len(self._shapes) > SHAPE_CACHE_SIZE:
                self._shapes.popitem(last=False)
        return loss

    def _fail(self, exc: BaseException, action: Action | None) -> None:
        where = f" while running {action}" if action is not None else ""
        message = f"{type(exc).__name__}: {exc}{where}"
        self._broken = message
        if not isinstance(exc, PeerFailedError):
            self.watchdog.report(f"{message}")
            if hasattr(exc, "add_note"):
                exc.add_note(f"duplexpipe: rank {self.rank} failed{where}; the other ranks were told to stop")

    # ---------------------------------------------------------------- tensors in and out
    def _rank_of(self, stage: int | None) -> int:
        assert stage is not None
        return self.schedule.stages[stage].rank

    def _input(self, ctx: StepContext, stage: int, mb: int, consumer: Action) -> Tensor:
        if self.schedule.is_first(stage):
            if mb not in ctx.inputs:
                raise PipelineError(f"rank {self.rank}: {consumer} has no input rows for microbatch {mb}")
            return ctx.inputs[mb]
        prev = self.schedule.prev_stage(stage)
        if self._rank_of(prev) != self.rank:
            return self.transport.take((Op.RECV_F, stage, mb), str(consumer))
        if (stage, mb) not in ctx.local_fwd:
            raise PipelineError(f"rank {self.rank}: {consumer} runs before {prev}F{mb} produced its input")
        return ctx.local_fwd.pop((stage, mb))

    def _output_grad(self, ctx: StepContext, stage: int, mb: int, consumer: Action) -> Tensor | None:
        if self.schedule.is_last(stage):
            return None
        nxt = self.schedule.next_stage(stage)
        if self._rank_of(nxt) != self.rank:
            return self.transport.take((Op.RECV_B, stage, mb), str(consumer))
        if (stage, mb) not in ctx.local_grad:
            raise PipelineError(f"rank {self.rank}: {consumer} runs before stage {nxt}'s backward of "
                                f"microbatch {mb} produced its gradient")
        return ctx.local_grad.pop((stage, mb))

    def _hand_on(self, ctx: StepContext, stage: int, mb: int, out: Tensor) -> None:
        nxt = self.schedule.next_stage(stage)
        assert nxt is not None
        if self._rank_of(nxt) == self.rank:
            ctx.local_fwd[(nxt, mb)] = out.detach()
            return
        meta = TensorMeta.of(out)
        expected = ctx.shapes.get((nxt, mb))
        if not ctx.learning and expected != meta:
            raise ActivationShapeError(
                f"stage {stage} microbatch {mb}: produced an activation of shape {meta} but {expected} "
                f"was expected (announced the first time these input shapes were seen; a stage's output "
                "shape must depend only on its input shape)")
        if ctx.learning:
            ctx.shapes[(nxt, mb)] = meta
            self.board.announce(ctx.step, nxt, mb, meta)
        ctx.outbox[(Op.SEND_F, stage, mb)] = out.detach()

    def _hand_back(self, ctx: StepContext, stage: int, mb: int, dinput: Tensor | None) -> None:
        prev = self.schedule.prev_stage(stage)
        if prev is None:
            return
        if dinput is None:
            raise PipelineError(f"stage {stage} microbatch {mb}: its input is not a floating-point tensor, "
                                f"so no gradient can flow back to stage {prev}")
        if self._rank_of(prev) == self.rank:
            ctx.local_grad[(prev, mb)] = dinput
        else:
            ctx.outbox[(Op.SEND_B, stage, mb)] = dinput

    # ---------------------------------------------------------------- compute handlers
    def _do_forward(self, ctx: StepContext, action: Action, inp: Tensor) -> None:
        stage, mb = action.stage, action.microbatch
        compute = self.stages[stage]
        with torch.set_grad_enabled(ctx.train):
            leaf, out = compute.forward(inp, mb, ctx.train)
            if not self.schedule.is_last(stage):
                if ctx.train:
                    ctx.acts[(stage, mb)] = compute.keep(leaf, out, mb)
                    ctx.out_meta[(stage, mb)] = TensorMeta.of(out)
                    ctx.activation_born()
                self._hand_on(ctx, stage, mb, out)
                return
            if not ctx.train:
                ctx.outputs[mb] = out.detach()
            if mb not in ctx.targets:
                return
            loss = compute.loss(out, ctx.targets[mb], self.loss_fn, mb)
            ctx.losses.append(loss.detach().double() * ctx.weights[mb])
            if ctx.train:
                scaled = loss * (ctx.weights[mb] * ctx.loss_scale)
                ctx.acts[(stage, mb)] = compute.keep(leaf, scaled, mb)
                ctx.activation_born()

    def _do_backward(self, ctx: StepContext, action: Action, grad: Tensor | None) -> None:
        stage, mb = action.stage, action.microbatch
        act = ctx.acts.get((stage, mb))
        if act is None or act.weight_work is not None:
            raise PipelineError(f"rank {self.rank}: {action} runs without a pending forward {stage}F{mb}")
        compute = self.stages[stage]
        if action.op is Op.B:
            dinput = compute.backward(act, grad)
            del ctx.acts[(stage, mb)]
            ctx.live -= 1
        else:
            dinput = compute.backward_input(act, grad)
        self._hand_back(ctx, stage, mb, dinput)

    def _forward(self, ctx: StepContext, action: Action) -> None:
        inp = self._input(ctx, action.stage, action.microbatch, action)
        with self.tracer.span(action):
            self._do_forward(ctx, action, inp)

    def _backward(self, ctx: StepContext, action: Action) -> None:
        grad = self._output_grad(ctx, action.stage, action.microbatch, action)
        with self.tracer.span(action):
            self._do_backward(ctx, action, grad)

    def _weight(self, ctx: StepContext, action: Action) -> None:
        act = ctx.acts.get((action.stage, action.microbatch))
        if act is None or act.weight_work is None:
            raise PipelineError(f"rank {self.rank}: {action} runs without a pending "
                                f"{action.stage}I{action.microbatch}")
        with self.tracer.span(action):
            self.stages[action.stage].backward_weight(act, action.microbatch)
        del ctx.acts[(action.stage, action.microbatch)]
        ctx.live -= 1

    def _overlap(self, ctx: StepContext, action: Action) -> None:
        fwd, bwd = action.parts
        inp = self._input(ctx, fwd.stage, fwd.microbatch, action)
        grad = self._output_grad(ctx, bwd.stage, bwd.microbatch, action)
        ran: list[str] = []

        def run_forward() -> None:
            if "F" in ran:
                raise PipelineError(f"overlap_hook ran the forward part of {action} twice")
            ran.append("F")
            self._do_forward(ctx, fwd, inp)

        def run_backward() -> None:
            if "B" in ran:
                raise PipelineError(f"overlap_hook ran the backward part of {action} twice")
            ran.append("B")
            self._do_backward(ctx, bwd, grad)

        hook = self.config.overlap_hook or default_overlap
        with self.tracer.span(action):
            hook(action, run_forward, run_backward)
        if sorted(ran) != ["B", "F"]:
            raise PipelineError(f"overlap_hook must run both parts of {action} once; it ran {ran or 'none'}")

    # ---------------------------------------------------------------- comm handlers
    def _recv(self, ctx: StepContext, action: Action) -> None:
        stage, mb = action.stage, action.microbatch
        if action.op is Op.RECV_B:
            peer = self._rank_of(self.schedule.next_stage(stage))

            def resolve(block: bool) -> TensorMeta | None:
                meta = ctx.out_meta.get((stage, mb))
                if meta is None and block:
                    raise PipelineError(f"rank {self.rank}: {action} is consumed before {stage}F{mb} ran")
                return meta
        else:
            peer = self._rank_of(self.schedule.prev_stage(stage))

            def resolve(block: bool) -> TensorMeta | None:
                if not ctx.learning:
                    if (stage, mb) not in ctx.shapes:
                        raise PipelineError(f"rank {self.rank}: no shape is known for {action}")
                    return ctx.shapes[(stage, mb)]
                meta = self.board.lookup(ctx.step, stage, mb, block, peer)
                if meta is not None:
                    ctx.shapes[(stage, mb)] = meta
                return meta
        self.transport.expect((action.op, stage, mb), peer, resolve)

    def _send(self, ctx: StepContext, action: Action) -> None:
        key = (action.op, action.stage, action.microbatch)
        if key not in ctx.outbox:
            raise PipelineError(f"rank {self.rank}: {action} runs before the compute that produces "
                                "its tensor")
        nxt = (self.schedule.next_stage(action.stage) if action.op is Op.SEND_F
               else self.schedule.prev_stage(action.stage))
        self.transport.send(key, ctx.outbox.pop(key), self._rank_of(nxt))

    # ---------------------------------------------------------------- evaluate outputs
    def _gather_outputs(self, ctx: StepContext) -> Tensor | None:
        mine = [ctx.outputs[mb] for mb in sorted(ctx.outputs)]
        if not mine:
            return None
        block = torch.cat(mine, dim=0)
        last_ranks = sorted({self.schedule.stages[s].rank for s in range(self.schedule.num_stages)
                             if self.schedule.is_last(s)})
        if len(last_ranks) == 1:
            return block
        peers = [r for r in last_ranks if r != self.rank]
        got = share_blocks(block, peers, self._global_ranks, self.group, self.device, self.watchdog)
        first_mb = {r: min(mb for s in range(self.schedule.num_stages) if self.schedule.is_last(s)
                           and self.schedule.stages[s].rank == r
                           for mb in self.schedule.microbatches_of_stage(s)) for r in last_ranks}
        blocks = {self.rank: block, **got}
        return torch.cat([blocks[r] for r in sorted(last_ranks, key=lambda r: first_mb[r])], dim=0)
