"""PipelineRuntime: a thin interpreter running one rank's instruction list over torch.distributed."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from duplexpipe.comm.codec import codec_name
from duplexpipe.comm.nonfinite import NonFiniteWatch
from duplexpipe.config.activations import check_offload
from duplexpipe.errors import HandshakeError, PeerFailedError, PipelineError, ScheduleError
from duplexpipe.runtime import structure
from duplexpipe.runtime.backend import default_device, is_nccl
from duplexpipe.runtime.collectives import Agreement, BatchAgreement, MirrorSum, agree, share_blocks
from duplexpipe.runtime.comm_points import Driver
from duplexpipe.runtime.config import EvalResult, Residency, RuntimeConfig, StepResult
from duplexpipe.runtime.dispatch import Dispatcher
from duplexpipe.runtime.handshake import group_store, handshake, shared_nonce
from duplexpipe.runtime.loss_sum import LossSum
from duplexpipe.runtime.memory import MeasuredActivations, StepMemory, measured
from duplexpipe.runtime.message_meta import Message, MessageMeta
from duplexpipe.runtime.messages import Mailbox, Mailroom, Slot
from duplexpipe.runtime.offload import Offload, enabled
from duplexpipe.runtime.preflight import verdict
from duplexpipe.runtime.rankplan import RankPlan
from duplexpipe.runtime.stage_compute import Activations, StageCompute
from duplexpipe.runtime.step import Step, microbatch_rows, signature, split_batch
from duplexpipe.runtime.timing import Tracer
from duplexpipe.runtime.transport import MailTransport
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.ir import Action, Schedule
from duplexpipe.schedules.offload import offload_plan
from duplexpipe.schedules.timeline import Span, Timeline

__all__ = ["PipelineRuntime"]

EP_LANE = "ep"
"""The timeline lane of the exchanges inside stage compute (expert-parallel all-to-alls)."""
SHAPE_CACHE_SIZE = 8
"""How many distinct input-shape signatures keep their learned activation shapes."""


class PipelineRuntime:
    """Executes this rank's list of a (lowered) Schedule: one step = one pass over the list.

    Messages between stages: a stage takes and returns a tensor, or tuples/lists/dicts (str keys,
    nested) of tensors. A tuple/list is passed to the next stage as positional arguments, a dict as
    keyword arguments, a tensor as one argument; a module whose `structure.WHOLE_MESSAGE` attribute
    is True gets the structure as one argument (as nn.Sequential does). Floating tensors that
    require grad carry gradients back; the others (integer masks, ids, tensors computed under
    no_grad) flow forward only. The first stage's `inputs` and the last stage's `targets` may be
    such structures too: every leaf is split along dim 0 into the microbatches.

    A stage's output shapes must depend only on its input shapes: they are announced through
    the c10d store on the first step and whenever the batch's shapes change, and checked
    against the announcement otherwise (ActivationShapeError naming the leaf's path).
    `loss_fn(output, target)` receives the last stage's output structure and the targets
    structure and must return the mean over the microbatch's samples; microbatch losses are
    weighted by their share of the batch rows, so uneven splits give the gradients of the mean
    loss over the whole batch.

    `modules` maps each stage this rank runs (schedule.stages_of_rank) to its module, already
    on `device`. Inputs are needed on ranks holding a first stage, targets on ranks holding a
    last stage (DualPipe: ranks 0 and P-1 hold both; V schedules: rank 0 holds both).
    A compute-only schedule is lowered first, and every schedule must pass the verifier before
    anything runs (on NCCL also its pair-order rule): an unsound one raises ScheduleError with the
    verifier's report (the deadlock cycle) on every rank, within seconds. Construction is
    collective: every rank of `group` checks that all run the same schedule (HandshakeError
    otherwise).

    `job_group` (default `group`): every rank of the training job, a group made of whole
    pipelines (e.g. the pp x dp world, each data-parallel replica training on its own batch).
    StepResult.loss is summed over it once per step (the mean over its pipelines), and a failure
    on any of its ranks stops all of them; `bounded` waits for the job's own collectives the same
    way.
    """

    def __init__(self, schedule: Schedule, modules: Mapping[int, nn.Module],
                 loss_fn: Callable[[Any, Any], Tensor], *, group: Any = None,
                 device: torch.device | None = None, config: RuntimeConfig | None = None,
                 job_group: Any = None, activation_offload: bool | float = False) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a duplexpipe Schedule, got {type(schedule).__name__}")
        if not schedule.has_comms and schedule.num_ranks > 1:
            from duplexpipe.schedules.lower import lower
            schedule = lower(schedule)
        self.schedule = schedule
        self.config = config if config is not None else RuntimeConfig()
        self.group = group
        self.rank = dist.get_rank(group)
        self.device = torch.device(device) if device is not None else default_device(group)
        self.loss_fn = loss_fn
        self.modules = dict(modules)
        self.job_group = job_group if job_group is not None else group
        self._pipelines, extra = divmod(dist.get_world_size(self.job_group), dist.get_world_size(group))
        if extra or not self._pipelines:
            raise ValueError(f"job_group has {dist.get_world_size(self.job_group)} ranks, not a multiple of "
                             f"the pipeline group's {dist.get_world_size(group)}")
        self.watchdog = self._start(group)
        self.transport = MailTransport(group, self.device, self.watchdog, meter=self.config.p2p_meter)
        self.nonfinite = NonFiniteWatch(self.config.nonfinite_sends)
        """Counts (and reports) sends through a codec whose tensor held NaN or inf."""
        counting = self.config.count_saved_bytes or self.config.measure_memory
        self.stages = {s: StageCompute(s, m, self.config.autocast_dtype, counting,
                                       part=schedule.stages[s].group) for s, m in self.modules.items()}
        self._global_ranks = [self.transport.global_rank(r) for r in range(schedule.num_ranks)]
        self.mirror = (MirrorSum(schedule, self.rank, self.modules, group, self._global_ranks, self.watchdog)
                       if self.config.sum_mirrored_grads and schedule.num_copies > 1 else None)
        self.plan = RankPlan.of(schedule, self.rank, {s for s, _, _ in self.mirror.pairs} if self.mirror else ())
        if not self.watchdog.gloo:
            self.transport.connect(self._rank_pairs())
        self.mail = Mailroom(self.plan.layout, self.rank, self.transport, self._store, self._prefix, self.watchdog,
                             self.config.activation_codec, self.config.gradient_codec, self.nonfinite)
        self.driver = Driver(self._wait_exchange)
        """Runs the exchanges inside stage compute (`link_emulator.emulate_link` may set an emulated link on it;
        while a step records its timeline, its log is that step's `exchanges`)."""
        self.dispatch = Dispatcher(self.plan.layout, self.rank, self.stages, self.mail, loss_fn, self.driver,
                                   self.config.fb_overlap, self.device)
        self.running: Step | None = None
        """The step running now (None between steps, and once a step failed: a failure drops it)."""
        self.origin = 0.0
        """time.perf_counter() at the latest step's start (time zero of its timeline)."""
        self._shapes: OrderedDict[tuple[int, bool], dict[Slot, MessageMeta]] = OrderedDict()
        """(input signature, training) -> the learned message metas (evaluate's carry no gradients)."""
        self._step_no = 0
        self._broken: str | None = None
        self.batches = BatchAgreement(self.config.check_inputs_every_step, self.rank, bool(self.plan.lasts))
        self._hoisted: dict[int, RankPlan] = {}
        """recv_lookahead -> this rank's plan with its receives posted that far ahead."""
        self._pending: LossSum | None = None
        """The latest step's loss sum until something waited for it."""
        check_offload(activation_offload, "activation_offload")
        self.activation_offload = activation_offload
        """Training steps move what forwards save for backward to host memory while their backward is far away
        (`duplexpipe.runtime.offload`): after each F, the live forwards whose B or I is furthest go to host (True:
        all but the nearest; a fraction f: the furthest floor(f x live)) and come back one compute action before
        their B or I. Exact; the step's MemoryReport counts those on host out of its activations and reports the
        bytes moved (`offloaded_bytes`)."""
        self._offload_stream = (torch.cuda.Stream(self.device) if enabled(activation_offload)
                                and self.device.type == "cuda" else None)
        """The side stream of the activation offload's copies (CUDA)."""
        self._handlers = self.dispatch.handlers()
        self._measured = ({op: measured(h) for op, h in self._handlers.items()}
                          if self.config.measure_memory else self._handlers)
        """The handlers of a measured step: each action followed by a sample of the step's memory."""

    def drive_residency(self, residency: Residency) -> None:
        """Run the schedule's UNSHARD / RESHARD / REDUCE_GRAD actions (`schedules.shard`) on `residency` (ZeRO-3's
        strategy), every compute once its stages' parameters are gathered, and the mirror sum on
        `residency.grad_holders`."""
        if self.mirror is not None:
            self.mirror.holders = residency.grad_holders
        self._handlers = self.dispatch.handlers(residency)
        self._measured = ({op: measured(h) for op, h in self._handlers.items()}
                          if self.config.measure_memory else self._handlers)

    def _wait_exchange(self, work: Any, what: str) -> None:
        """gloo: a bounded, failure-aware wait. NCCL: the compute stream waits for the exchange on the GPU and
        the CPU goes on queueing work (never a device-wide synchronize); the wait is bounded by the process
        group's own timeout, after which NCCL's watchdog aborts the ranks."""
        if self.watchdog.gloo:
            self.watchdog.wait_collective(work, what, "the expert-parallel group")
        else:
            work.wait()

    def _timeline(self, step: Step) -> Timeline | None:
        """This rank's measured step: compute events, and its exchanges on the "ep" lane."""
        timeline = step.trace.timeline(self.schedule.name, self.schedule.num_ranks, self.schedule.num_microbatches)
        if timeline is None or not step.exchanges:
            return timeline
        origin = step.trace.origin
        spans = tuple(Span(self.rank, EP_LANE, r.label, r.issued - origin, r.done - origin) for r in step.exchanges)
        return replace(timeline, spans=timeline.spans + spans)

    def _start(self, group: Any) -> Watchdog:
        """The start-up checks and handshake; returns the watchdog of this runtime's waits.

        The schedule must pass the verifier (and, on NCCL, its pair-order rule) before anything is
        sent: an unsound one raises ScheduleError with the verifier's report on every rank.
        """
        bad = {s: type(m).__name__ for s, m in self.modules.items() if not isinstance(m, nn.Module)}
        nccl = is_nccl(group)
        fingerprint = self.schedule.fingerprint()
        problem = verdict(self.schedule, fingerprint, nccl)
        local = (f"rank {self.rank}: modules must be nn.Module, got {bad}" if bad else
                 f"rank {self.rank}: the schedule fails verification: {problem}" if problem else "")
        codecs = f"{codec_name(self.config.activation_codec)}/{codec_name(self.config.gradient_codec)}"
        try:
            nonce = handshake(self.schedule, self.modules, group, self.device, self.config.timeout_s, local,
                              codecs, fingerprint)
        except HandshakeError:
            if problem:  # every rank holding this schedule: the verifier's own report, cycle included
                raise ScheduleError(f"schedule {self.schedule.name!r} cannot run: {problem}") from None
            raise
        self._prefix = f"duplexpipe/{nonce}"
        self._store = group_store(group)
        job_store = group_store(self.job_group)
        if self._store is None or job_store is None:
            raise PipelineError("no c10d store is reachable for the process group: the runtime needs it "
                                "for shape announcements and the shared error flag")
        job_prefix, flag_rank, flag_label = self._prefix, self.rank, "rank"
        if self._pipelines > 1:  # one error flag for the whole job, naming global ranks
            job_prefix = "duplexpipe-job/" + shared_nonce(self.job_group, self.device, self.config.timeout_s,
                                                          "the start-up handshake of the job group")
            flag_rank, flag_label = dist.get_rank(), "global rank"
        return Watchdog(job_store, job_prefix, self.rank, self.config.timeout_s, self.config.poll_interval_s,
                        gloo=not nccl, flag_rank=flag_rank, flag_label=flag_label)

    def _rank_pairs(self) -> list[tuple[int, int]]:
        """The pairs of group ranks that exchange messages: the stage chains', the mirrored gradient sum's
        (DualPipe) and the batch agreement's (rank 0 with every rank), sorted."""
        size = dist.get_world_size(self.group)
        pairs = set(self.plan.layout.rank_pairs()) | {(0, r) for r in range(1, size)}
        if self.mirror is not None:
            stages = self.schedule.stages
            pairs |= {(min(a.rank, b.rank), max(a.rank, b.rank)) for a, b in itertools.combinations(stages, 2)
                      if a.group == b.group and a.rank != b.rank}
        return sorted(pairs)

    # ---------------------------------------------------------------- public API
    def step(self, inputs: Any, targets: Any, *, loss_scale: float = 1.0) -> StepResult:
        """One training step over the whole batch (split into the schedule's microbatches).

        Gradients accumulate into .grad (never zeroed here) and equal those of
        loss_scale * (mean loss over the batch). Returns the mean loss on every rank; its sum
        over the ranks completes in the background (reading StepResult.loss, or the next call,
        waits for it).
        """
        step = self._begin(inputs, targets, train=True, loss_scale=loss_scale)
        self._run(step)
        self._pending = step.loss
        loss = functools.partial(self._read, step.loss) if step.loss is not None else 0.0
        memory = step.memory.report() if step.memory is not None else None
        if memory is not None and step.offload is not None:
            memory = replace(memory, offloaded_bytes=step.offload.offloaded_bytes)
        return StepResult(loss=loss, timeline=self._timeline(step), peak_activations=step.acts.peak,
                          peak_saved_bytes=step.acts.peak_bytes, memory=memory)

    def evaluate(self, inputs: Any, targets: Any = None) -> EvalResult:
        """Forward only (the schedule's F actions in order, no autograd).

        Returns the outputs for the whole batch in batch order on ranks holding a last
        stage (None elsewhere; a structure when the last stage returns one, each leaf
        concatenated) and, when targets were given, the mean loss on every rank of `group`.
        """
        step = self._begin(inputs, targets, train=False, loss_scale=1.0)
        with torch.no_grad():
            self._run(step)
            loss = self._read(step.loss) if step.loss is not None else None
            with self._stopping():
                outputs = self._gather_outputs(step.outputs) if self.plan.lasts else None
        return EvalResult(outputs=outputs, loss=loss, timeline=self._timeline(step))

    def report_failure(self, exc: BaseException) -> None:
        """Stop this runtime because of `exc` (raised by code around it, e.g. the optimizer step) and
        tell every rank of the job, whose waits then raise PeerFailedError naming this rank."""
        if self._broken is None:
            self._fail(exc, None)

    def bounded(self, work: Any, what: str, peers: str = "all ranks of the group") -> None:
        """Wait for a collective posted with async_op=True (e.g. a data-parallel all-reduce) like the
        runtime's own waits: bounded by timeout_s and stopped when any rank of the job reported a
        failure. A failure here stops this runtime and tells the other ranks."""
        with self._stopping():
            self.watchdog.wait_collective(work, what, peers)

    # ---------------------------------------------------------------- step frame
    def _check_inputs(self, inputs: Any, targets: Any, train: bool) -> tuple[list[Any], list[Any], str]:
        m = self.schedule.num_microbatches
        chunks: list[Any] = []
        target_chunks: list[Any] = []
        try:
            if self.plan.firsts:
                if inputs is None:
                    raise ValueError(f"rank {self.rank} holds first stage(s) {list(self.plan.firsts)}: "
                                     "inputs are required")
                chunks = split_batch(inputs, m, "inputs")
            if self.plan.lasts and targets is not None:
                target_chunks = split_batch(targets, m, "targets")
            elif self.plan.lasts and train:
                raise ValueError(f"rank {self.rank} holds last stage(s) {list(self.plan.lasts)}: "
                                 "targets are required")
        except ValueError as exc:
            return [], [], str(exc)
        return chunks, target_chunks, ""

    def _agree(self, inputs: Any, targets: Any, train: bool) -> tuple[Agreement, list[Any], list[Any]]:
        """The batch every rank agreed on (ValueError on every rank when it cannot run) and this rank's
        microbatches of inputs and targets."""
        if self._broken is not None:
            restart = ("build a new one" if self.watchdog.gloo else "restart the processes (on NCCL the "
                       "failed step's transfers may still be pending on the GPU)")
            raise PipelineError(f"rank {self.rank}: this PipelineRuntime stopped after an error "
                                f"({self._broken}); {restart}")
        pending, self._pending = self._pending, None
        if pending is not None:
            self._read(pending)
        chunks, target_chunks, error = self._check_inputs(inputs, targets, train)
        target_rows = structure.rows(targets) if target_chunks else (-1 if self.plan.lasts else None)
        with self._stopping():  # a mismatch with a kept agreement stops every rank: the others cannot see it
            kept = self.batches.reuse(inputs, targets, error) if train else None
            found = kept or agree(structure.rows(inputs) if chunks else None,
                                  signature(inputs, len(chunks)) if chunks else None,
                                  target_rows, bool(error), self.group, self.device, self.watchdog)
        if kept is None:  # bad batches raise ValueError on every rank alike; the runtime stays usable
            self.batches.accept(found, error, train, inputs if chunks else None)
        return found, chunks, target_chunks

    def _begin(self, inputs: Any, targets: Any, train: bool, loss_scale: float) -> Step:
        """Start a step (or evaluation): the agreed batch, then a new Step holding all that lives only for it (its
        plan: the loss sum's post position comes from it)."""
        found, chunks, target_chunks = self._agree(inputs, targets, train)
        self._step_no += 1
        cached = self._shapes.get((found.signature, train))
        plan = self._plan_of(cached is not None)
        to_device = self._to_device
        batch = {}
        for mb, chunk in enumerate(chunks):
            form, leaves = structure.flatten(chunk, "inputs")
            batch[mb] = Message(form, [to_device(t) for t in leaves], (False,) * form.num_leaves)
        targets_of = {mb: structure.map_leaves(to_device, c) for mb, c in enumerate(target_chunks)}
        weights = [r / found.batch for r in microbatch_rows(found.batch, self.schedule.num_microbatches)]
        with self._stopping():  # the loss sum posts its receives (and a share) as it starts
            loss = self._loss_sum(train, plan) if train or found.target_rows >= 0 else None
            measuring = train and self.config.measure_memory
            acts = MeasuredActivations(self.rank) if measuring else Activations(self.rank)
            step = Step(train, self._step_no, found, plan, weights, float(loss_scale), batch, targets_of, loss,
                        Mailbox.of(self._step_no, train, cached), acts,
                        Tracer(self.rank, self.device, self.config.record_timeline))
            if train and enabled(self.activation_offload):
                step.offload = Offload(offload_plan(plan.actions, self.activation_offload), acts,
                                       self.device, self._offload_stream)
            if isinstance(acts, MeasuredActivations):
                step.memory = acts.memory = self._measure(step)
            if train and self.mirror is not None:
                step.set_aside = self.mirror.set_aside()
        self.driver.log = step.exchanges if self.config.record_timeline else None
        self.origin = step.trace.origin
        self.running = step
        return step

    def _measure(self, step: Step) -> StepMemory:
        """The memory measurement of a step, with its first sample (what the rank holds as the step starts)."""
        mail, transport = step.mail, self.transport
        memory = StepMemory(self.rank, self.modules, step.acts, lambda: mail.held() + transport.held(), self.device,
                            step.trace.origin)
        memory.sample("start")
        return memory

    def _to_device(self, tensor: Tensor) -> Tensor:
        return tensor.to(self.device)

    def _read(self, loss: LossSum) -> float:
        """Wait for a loss sum; a failure stops the runtime like a failed step."""
        with self._stopping():
            return loss.value()

    def _grads_final(self, stages: tuple[int, ...]) -> None:
        hook = self.config.on_grads_ready
        if hook is not None:
            for stage in stages:
                hook(stage)

    def _loss_sum(self, train: bool, plan: RankPlan) -> LossSum:
        """The step's loss sum: on gloo with one pipeline (and in evaluate) the ranks holding last stages send
        their share straight to every rank; else an all-reduce over the job group (the pipeline group in
        evaluate). Posted where `plan` says (see LossSum)."""
        shared = self.watchdog.gloo and (self._pipelines == 1 or not train)
        return LossSum(plan.losses_final if train else plan.eval_losses_final, gloo=self.watchdog.gloo,
                       sources=self.plan.output_ranks if shared else None,
                       group=self.group if shared or not train else self.job_group, device=self.device,
                       watchdog=self.watchdog, divisor=self._pipelines if train else 1)

    def _plan_of(self, shapes_known: bool) -> RankPlan:
        """The plan a step runs: the schedule's, or (message shapes known, gloo) the one whose receives are
        posted `recv_lookahead` receives ahead (built once per depth)."""
        depth = self.config.recv_lookahead
        if not shapes_known or depth == 0 or not self.watchdog.gloo:
            return self.plan
        plan = self._hoisted.get(depth)
        if plan is None:
            plan = self._hoisted[depth] = self.plan.hoisted(depth)
        return plan

    def _run(self, step: Step) -> None:
        """Interpret this rank's list. The loss sum starts before it and this rank's share is posted where the
        step's plan says (gloo: as soon as its losses are final, so the sum completes while the step runs; NCCL:
        after the list, see LossSum). Every rank takes part."""
        at: list[Action | None] = [None]
        plan = step.plan
        actions = plan.actions if step.train else plan.eval_actions
        after = self._after(step)
        handlers = self._handlers if step.memory is None else self._measured
        reap = None if self.watchdog.gloo else self.transport.reap  # gloo: see _after and finish()
        recomputes = step.memory.recomputes.collecting() if step.memory is not None else contextlib.nullcontext()
        with self._stopping(at), recomputes:
            for pos, action in enumerate(actions):
                at[0] = action
                handlers[action.op](step, action)
                if reap is not None:
                    reap()
                if pos in after:
                    after[pos]()
            at[0] = None
            self.transport.finish()
            if step.memory is not None:
                step.memory.sample("end")
            if step.loss is not None:
                step.loss.post()
            self.nonfinite.read(step.mail.unread)
            left = (step.acts.left() if step.train else []) + step.mail.leftovers()
            if left:
                raise PipelineError(f"rank {self.rank}: the schedule left work undone: " + "; ".join(left))
            if step.train and self.mirror is not None:
                self.mirror.sum(step.set_aside)
                self._grads_final(self.plan.mirrored)
        self.running = None
        if step.mail.learning:
            self._shapes[(step.signature, step.train)] = step.mail.shapes
            while len(self._shapes) > SHAPE_CACHE_SIZE:
                self._shapes.popitem(last=False)

    def _after(self, step: Step) -> dict[int, Callable[[], None]]:
        """What runs after the action at a position of the step's list: the stages' final-gradient hook
        (`on_grads_ready`), the release of sends the schedule proves complete (gloo), the activation offload's
        moves and the loss sum's post (gloo)."""
        after: dict[int, Callable[[], None]] = {}
        if step.train and self.config.on_grads_ready is not None:
            for pos, stages in step.plan.grads_final.items():
                after[pos] = functools.partial(self._grads_final, stages)
        if step.train and self.watchdog.gloo:
            for pos, keys in step.plan.sends_done_at().items():
                release = functools.partial(self.transport.release, keys)
                final = after.get(pos)
                after[pos] = release if final is None else functools.partial(_both, final, release)
        if step.offload is not None:
            for pos, move in step.offload.hooks().items():
                final = after.get(pos)
                after[pos] = move if final is None else functools.partial(_both, final, move)
        loss = step.loss
        if loss is not None and loss.post_after is not None:
            final = after.get(loss.post_after)
            after[loss.post_after] = (loss.post if final is None else
                                      functools.partial(_both, final, loss.post))
        return after

    @contextlib.contextmanager
    def _stopping(self, at: list[Action | None] | None = None) -> Iterator[None]:
        """Stop this runtime when the body raises (`at[0]`: the action running then). A RuntimeError
        from torch.distributed after another rank reported a failure (and broke the connections)
        becomes that rank's PeerFailedError. Once stopped, errors pass through unchanged."""
        try:
            yield
        except BaseException as exc:
            if self._broken is not None:
                raise
            failure: BaseException = exc
            if isinstance(exc, RuntimeError) and not isinstance(exc, PipelineError):
                try:
                    self.watchdog.check()
                except PeerFailedError as peer_failed:
                    failure = peer_failed
            self._fail(failure, at[0] if at else None)
            if failure is exc:
                raise
            raise failure from exc

    def _fail(self, exc: BaseException, action: Action | None) -> None:
        where = f" while running {action}" if action is not None else ""
        message = f"{type(exc).__name__}: {exc}{where}"
        self._broken = message
        if not isinstance(exc, PeerFailedError):
            self.watchdog.report(f"{message}")
            if hasattr(exc, "add_note"):
                exc.add_note(f"duplexpipe: rank {self.rank} failed{where}; the other ranks were told to stop")
        self.transport.poison()  # ends every pending transfer of the group: the waiting ranks read the flag
        self.running = None  # the failed step (graphs, messages) is dropped

    # ---------------------------------------------------------------- evaluate outputs
    def _gather_outputs(self, outputs: dict[int, Any]) -> Any:
        if not outputs:
            return None
        mine = structure.concat([outputs[mb] for mb in sorted(outputs)])
        if len(self.plan.output_ranks) == 1:
            return mine
        form, leaves = structure.flatten(mine, "output")
        peers = [r for r in self.plan.output_ranks if r != self.rank]
        columns: list[list[Tensor]] = []
        for leaf in leaves:
            got = share_blocks(leaf, peers, self._global_ranks, self.group, self.device, self.watchdog)
            blocks = {self.rank: leaf, **got}
            columns.append([blocks[r] for r in self.plan.output_ranks])
        return structure.unflatten(form, [torch.cat(c, dim=0) for c in columns])


def _both(first: Callable[[], None], second: Callable[[], None]) -> None:
    first()
    second()
