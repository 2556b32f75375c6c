"""The data-parallel strategy interface: reduce (bucket by bucket) -> overflow check -> clip -> optimizer step."""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from duplexpipe.comm import FutureWork, Waitable, WireMeter
from duplexpipe.comm.adaptive import CompressionReport
from duplexpipe.comm.link import EmulatedLink
from duplexpipe.config.sections import DEFAULT_BUCKET_BYTES
from duplexpipe.dp_options.compression import NoCompression, Options
from duplexpipe.dp_options.zero import ZeroOptions
from duplexpipe.parallel import grads
from duplexpipe.parallel.buckets import BucketSpec, BucketTracker, plan_buckets
from duplexpipe.parallel.local_shards import LocalShards
from duplexpipe.parallel.mesh import ParallelGroups
from duplexpipe.schedules.ir import Schedule
from duplexpipe.schedules.timeline import Span
from duplexpipe.tp.parallelize import counts_here

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Builds the optimizer from this rank's parameters, e.g. `lambda ps: torch.optim.AdamW(ps, lr=1e-3)`."""
WaitFn = Callable[[Any, str], None]
"""wait(work, what): waits for a collective posted with async_op=True, bounded and failure-aware
(PipelineRuntime.bounded); `what` names it in errors."""
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""How checkpoints hold the optimizer state: per parameter, keys `state.<param>.<name>`."""
DP_LANE = "dp"
"""The timeline lane of the data-parallel reductions (see Span)."""
EXPOSED_FLOOR_S = 1e-4
"""A wait on a reduction shorter than this is the cost of looking (it had completed): no exposure."""
EXPOSED_LANE = "exposed"
"""The timeline lane of exposed communication: the time the step waited on each bucket's reduction."""


@dataclass(frozen=True)
class StrategyContext:
    """What a data-parallel strategy is built from (the Pipeline makes one per rank)."""

    modules: Mapping[int, nn.Module]
    """This rank's stage modules, stage -> module (their parameters are the ones it reduces and steps)."""
    schedule: Schedule
    """The schedule: its stage table says which stage holds the first copy of each weight group."""
    final_order: tuple[int, ...]
    """This rank's stages in the order their gradients become final in a step (buckets.final_order)."""
    groups: ParallelGroups
    """Where this process sits in the pp x dp mesh (its data-parallel group, rank and size)."""
    optimizer_factory: OptimizerFactory
    """Builds the optimizer from parameters (a strategy may build it over a shard, or wrap it)."""
    device: torch.device
    """Where the gradients live."""
    wait: WaitFn
    """Bounded, failure-aware wait for an async collective (every wait of a strategy goes through it)."""
    compression: Options = field(default_factory=NoCompression)
    """Gradient compression (duplexpipe.comm options; NoCompression: exact)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Bucket capacity in bytes."""
    zero_stage: int = 0
    """ZeRO stage (0: replicated or compressed; 1: optimizer state sharded; 2: gradients too)."""
    zero: ZeroOptions = field(default_factory=ZeroOptions)
    """ZeRO++ options (quantized gradients / weights, hpZ)."""
    experts: frozenset[int] = frozenset()
    """id() of this rank's routed-expert parameters (MoE with expert parallelism): reduced over the
    expert-data-parallel group, never over the data-parallel group's other experts' holders."""


class LaneRecorder:
    """perf_counter times of one step's bucket reductions: started, seen complete (a completion callback on
    the first collective), and the main thread's final wait; turned into Spans on the "dp" lane."""

    def __init__(self) -> None:
        self.started: dict[int, tuple[float, list[float]]] = {}
        self.wait: tuple[float, float] | None = None

    def reset(self) -> None:
        """Forget the previous step."""
        self.started, self.wait = {}, None

    def start(self, index: int, begin: float, work: Waitable | None) -> None:
        """Bucket `index` started at `begin`; time the completion of `work` (its first collective)."""
        done: list[float] = []
        self.started[index] = (begin, done)
        future = work.future if isinstance(work, FutureWork) else None
        if future is None and hasattr(work, "get_future"):
            try:
                future = work.get_future()  # type: ignore[union-attr]
            except RuntimeError:  # a backend without futures: the span ends at the final wait
                future = None
        if future is not None:
            future.then(lambda _: done.append(time.perf_counter()))

    def spans(self, origin: float, rank: int) -> list[Span]:
        """Spans relative to `origin`: "bucket i" from its start to its first collective's completion (or the
        end of the final wait), then "wait" for the time the main thread blocked in finish()."""
        end = self.wait[1] if self.wait is not None else None
        out = []
        for index, (begin, done) in sorted(self.started.items(), key=lambda kv: kv[1][0]):
            stop = done[0] if done else end
            if stop is not None:
                out.append(Span(rank, DP_LANE, f"bucket {index}", begin - origin, max(stop, begin) - origin))
        if self.wait is not None:
            out.append(Span(rank, DP_LANE, "wait", self.wait[0] - origin, self.wait[1] - origin))
        return out


class DPStrategy(ABC):
    """Owns the data-parallel part of an optimizer step on one rank of a pp x dp mesh.

    The Pipeline drives it on every call of step():
    1. begin_call(final, divisor) before the schedule runs (`final`: this call ends the accumulation window);
    2. grads_ready(stage) from the runtime's callback once the stage's gradients are final for the call
       (DualPipe: after the mirror sum): on final calls the buckets that became ready start reducing;
    3. at the window's end: finish() waits for every bucket (bounded), norm_and_overflow() shares the
       global norm and the overflow flag, then skip() (an overflowed fp16 step) or step(clip_coef).
    Every data-parallel replica of a pipeline rank runs the same instruction list, so they make the same
    calls in the same order and their collectives match. A subclass implements start_bucket() and
    finish_buckets(); ZeRO-style strategies also override build_optimizer(), step() and the state.
    """

    name: ClassVar[str] = "abstract"

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        stages = sorted(ctx.modules)
        self.params: list[nn.Parameter] = [p for s in stages for p in ctx.modules[s].parameters()]
        """This rank's parameters (stage order)."""
        self.expert_params = [p for p in self.params if id(p) in ctx.experts]
        """Its routed experts' parameters (reduced apart, see `ExpertGrads`)."""
        self.counted: list[nn.Parameter] = [p for s in stages if ctx.schedule.copy_of_stage(s) == 0
                                            for p in ctx.modules[s].parameters()]
        """Parameters of the first copy of each weight group (the global norm counts each group once)."""
        self.meter = WireMeter()
        """Ring-model bytes this rank put on the data-parallel wire (duplexpipe.comm.WireMeter)."""
        order = [s for s in ctx.final_order if s in ctx.modules] + [s for s in stages if s not in ctx.final_order]
        self.buckets: list[BucketSpec] = (
            plan_buckets([(s, [p for p in ctx.modules[s].parameters() if id(p) not in ctx.experts]) for s in order],
                         ctx.bucket_bytes)
            if ctx.groups.dp_size > 1 else [])
        """The fixed buckets (none without data parallelism)."""
        self.tracker = BucketTracker(self.buckets)
        self.lanes = LaneRecorder()
        self.final = False
        """Whether the current call ends the accumulation window (buckets start only then)."""
        self.divisor = 1.0
        """loss scale x window weight of the current window: the gradients in .grad are this many times
        the gradient of the window's mean loss."""
        self.compute_s = 0.0
        """Seconds this thread spent on the last window's reductions outside waits (flattening, compressing,
        decompressing, copying back): the compute a faster link could not save."""
        self._waited = 0.0
        self.clock: Callable[[], float] = time.perf_counter
        """The clock exposure is measured with (tests script it)."""
        self.exposed_s: dict[int, float] = {}
        """Bucket index -> seconds the last window's end waited on its reduction (after the last W feeding it)."""
        self._exposed_at: list[tuple[int, float, float]] = []
        self._window_begin = 0.0
        self._finish_begin = 0.0
        self._loss: float | None = None
        self.report: CompressionReport | None = None
        """Adaptive compression: what the last window chose and measured (None otherwise)."""
        self._local: LocalShards | None = None
        """Plain aliases of DTensor parameters' local shards (tensor parallelism), which the optimizer steps."""
        self.optimizer = self.build_optimizer()

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas."""
        return self.ctx.groups.dp_size

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer this strategy steps (default: the factory over all of this rank's parameters; with
        tensor-parallel (DTensor) parameters, over plain aliases of their local shards: the same arithmetic without
        DTensor's dispatch per operation, see `local_shards`)."""
        if not any(isinstance(p, DTensor) for p in self.params):
            return self.ctx.optimizer_factory(self.params)
        self._local = LocalShards(self.params)
        return self.ctx.optimizer_factory(self._local.shards)

    def zero_grad(self) -> None:
        """Drop every gradient (start of an accumulation window or a skipped step)."""
        if self._local is not None:
            self._local.clear_grads()
        self.optimizer.zero_grad(set_to_none=True)

    def begin_call(self, final: bool, divisor: float) -> None:
        """Before the schedule runs: whether this call ends the window, and the window's divisor."""
        self.final, self.divisor = final, divisor
        if final:
            self.tracker.begin()
            self.lanes.reset()
            self.compute_s = 0.0
            self.exposed_s, self._exposed_at = {}, []
            self._window_begin = self.clock()

    def note_loss(self, loss: float) -> None:
        """The window's loss (the same on every rank), for adaptive compression's loss guard."""
        self._loss = loss

    @contextlib.contextmanager
    def exposed(self, index: int) -> Iterator[None]:
        """Time the wait on bucket `index`'s reduction in finish_buckets(): its exposed communication is the time
        from the end of the window's compute (finish() began) until it completed, 0 when it had completed before
        this wait began (the step never waited for it). Reductions sharing a link finish in order, so a later
        bucket's exposure includes the earlier ones' transfers it queued behind."""
        begin = self.clock()
        try:
            yield
        finally:
            end = self.clock()
            waited = end - begin > EXPOSED_FLOOR_S
            self.exposed_s[index] = max(self.exposed_s.get(index, 0.0), end - self._finish_begin if waited else 0.0)
            self._exposed_at.append((index, begin, end))

    @property
    def window_s(self) -> float:
        """Seconds from the start of the window's last call to now (the step as adaptive compression sees it)."""
        return self.clock() - self._window_begin

    def emulate_link(self, link: EmulatedLink | None) -> None:
        """Hold every data-parallel collective of the buckets for an emulated link (benchmarks, tests; strategies
        without a reducer ignore it)."""
        return None

    def grads_ready(self, stage: int) -> None:
        """The runtime's callback: start the buckets that `stage`'s final gradients complete."""
        if self.final:
            for spec in self.tracker.ready(stage):
                self._start(spec)

    def _start(self, spec: BucketSpec) -> None:
        begin = time.perf_counter()
        self.lanes.start(spec.index, begin, self.start_bucket(spec))
        self.compute_s += time.perf_counter() - begin

    def wait(self, work: Any, what: str) -> None:
        """ctx.wait, timed (the time is not compute_s)."""
        begin = time.perf_counter()
        try:
            self.ctx.wait(work, what)
        finally:
            self._waited += time.perf_counter() - begin

    def finish(self) -> None:
        """Wait for every bucket's reduction (starting any whose stage never reported, in index order)."""
        for spec in self.tracker.pending():
            self._start(spec)
        begin, waited = time.perf_counter(), self._waited
        self._finish_begin = self.clock()
        self.finish_buckets()
        self._finish_experts()
        end = time.perf_counter()
        if self.lanes.started:  # nothing to show without data parallelism
            self.lanes.wait = (begin, end)
        self.compute_s += (end - begin) - (self._waited - waited)

    def _finish_experts(self) -> None:
        """Bring the expert gradients to the units the reduced dense gradients have: each expert's gradient
        is summed over the ranks holding it (the expert-data-parallel group; the tokens of the other
        replicas reached it through the all-to-alls) and divided by the data-parallel size, then scaled like
        the dense gradients (post_divisor / divisor)."""
        if not self.expert_params or not self.final:
            return
        found = grads.ensure_grads(self.expert_params)
        groups = self.ctx.groups
        if groups.edp_size > 1:
            flat = torch.cat([g.reshape(-1) for g in found])
            self.meter.record("all_reduce", flat.numel() * flat.element_size(), groups.edp_size)
            self.wait(dist.all_reduce(flat, group=groups.edp_group, async_op=True),
                      "the expert gradients' all-reduce over the expert-data-parallel group")
            offset = 0
            for g in found:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        factor = self.post_divisor / (self.divisor * groups.dp_size)
        if factor != 1.0:
            for g in found:
                g.mul_(factor)

    def counted_grads(self) -> list[torch.Tensor]:
        """The gradients this rank adds to the global norm: its weight groups' first copies, once over the
        replicas (dense ones on data-parallel rank 0; experts on each expert-parallel rank of the first
        expert-data-parallel replica) and once over the TP group (shards on every TP rank, whole parameters on TP
        rank 0: `tensor.counts_here`)."""
        groups = self.ctx.groups
        dense_here = groups.dp_rank == 0
        experts_here = groups.dp_rank < groups.ep_size
        return [p.grad for p in self.counted if p.grad is not None and counts_here(p, groups.tp_rank)
                and (experts_here if id(p) in self.ctx.experts else dense_here)]

    @abstractmethod
    def start_bucket(self, spec: BucketSpec) -> Waitable | None:
        """Start reducing bucket `spec` asynchronously; return its first collective (to time it) or None."""

    @abstractmethod
    def finish_buckets(self) -> None:
        """Wait for the started reductions (with self.wait) and leave the reduced gradients in .grad."""

    @property
    def post_divisor(self) -> float:
        """What the reduced gradients must still be divided by (the divisor, unless the strategy unscaled
        them before reducing)."""
        return self.divisor

    def local_overflow(self) -> bool | torch.Tensor:
        """A non-finite gradient this rank saw before reducing (strategies that compress check there)."""
        return False

    def checked_grads(self) -> list[torch.Tensor]:
        """The gradients scanned for inf/NaN after the reduction."""
        return [p.grad for p in self.params if p.grad is not None]

    def norm_and_overflow(self, need: bool) -> tuple[float | None, bool]:
        """(global gradient norm of the window's mean loss, overflow anywhere), shared by every rank of the
        job; (None, False) without a collective when not `need`ed. Each weight group counts once over PP x DP."""
        if not need:
            return None, False
        raw, overflow = grads.global_norm_and_overflow(
            self.counted_grads(), self.checked_grads(), None, self.ctx.device,
            count_here=True, wait=self.ctx.wait, flagged=self.local_overflow())
        return raw / self.post_divisor, overflow

    def skip(self) -> None:
        """An overflowed step: drop the gradients, leave the optimizer and any compressor state untouched."""
        self.zero_grad()
        self.end_step(applied=False)

    def step(self, clip_coef: float) -> None:
        """Scale the gradients by clip_coef / post_divisor and step the optimizer."""
        grads.scale_grads(self.params, clip_coef / self.post_divisor)
        if self._local is not None:
            self._local.take_grads()
        self.optimizer.step()
        self.end_step(applied=True)

    def end_step(self, applied: bool) -> None:
        """Commit (applied) or roll back this step's state beyond the optimizer's (default: none)."""
        return None

    def checkpoint_dicts(self, modules: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, optimizer) state dicts of `modules` (this rank's stages keyed `stage<s>`) for a checkpoint,
        in torch's flattened form (creating the optimizer state if there is none yet). Loading fills them in."""
        with self._as_module_params():
            return get_state_dict(modules, self.optimizer, options=STATE_DICT_OPTIONS)

    def load_checkpoint_dicts(self, modules: nn.Module, model: dict[str, Any], optim: dict[str, Any]) -> None:
        """Take over the dicts checkpoint_dicts() made once the checkpoint has been read into them."""
        with self._as_module_params():
            set_state_dict(modules, self.optimizer, model_state_dict=model, optim_state_dict=optim,
                           options=STATE_DICT_OPTIONS)

    def _as_module_params(self) -> contextlib.AbstractContextManager[None]:
        """Inside, an optimizer over local-shard aliases holds the module's (DTensor) parameters and state."""
        return self._local.as_dtensors(self.optimizer) if self._local is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Inside, the stage modules' parameters hold their exact values (to export the model; a DTensor still needs
        `full_tensor()`); afterwards they are as before. Default: they always do."""
        yield

    def state_dict(self) -> dict[str, Any]:
        """This rank's strategy state beyond the model and optimizer ({} when none); checkpoints keep every
        rank's."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""
        if state:
            raise ValueError(f"the {self.name} data-parallel strategy keeps no state, got keys {sorted(state)}")

    def spans(self, origin: float, rank: int) -> list[Span]:
        """The last window-ending call's reductions as timeline spans on the "dp" lane, relative to `origin`
        (perf_counter seconds of the step's start); `rank` is the timeline's rank (the pipeline rank)."""
        exposed = [Span(rank, EXPOSED_LANE, f"bucket {i}", b - origin, e - origin) for i, b, e in self._exposed_at]
        return self.lanes.spans(origin, rank) + exposed
