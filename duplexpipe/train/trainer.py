"""The training API: `Pipeline` runs a schedule's steps; its data-parallel strategy reduces, clips and applies."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from duplexpipe.comm.adaptive import CompressionReport, ExposureReport, merged_reports
from duplexpipe.comm.adaptive_links import AdaptiveCodec, LinkAdapter
from duplexpipe.comm.meter import WireMeter
from duplexpipe.dp_options.compression import compression_options
from duplexpipe.dp_options.zero import check_window
from duplexpipe.errors import NonFiniteGradientError, PipelineError
from duplexpipe.model.split import (
    Balance,
    Partition,
    as_layers,
    build_parts,
    plan_partition,
)
from duplexpipe.model.stages import (
    Checkpointing,
    PartInit,
    PartSource,
    build_stage_modules,
    find_mismatched_copies,
    fingerprint,
    inner_module,
    model_parts,
    resolve_checkpointing,
)
from duplexpipe.parallel import (
    DPStrategy,
    OptimizerFactory,
    StrategyContext,
    final_order,
    grads,
    make_strategy,
)
from duplexpipe.parallel.compressed import own_group
from duplexpipe.parallel.mesh import ParallelGroups
from duplexpipe.parallel.strategy import EXPOSED_LANE
from duplexpipe.parallel.tied import TiedGrads, find_tied
from duplexpipe.parallel.zero3 import Zero3Strategy
from duplexpipe.parallel.zero_config import check_tied
from duplexpipe.runtime import EvalResult, PipelineRuntime, RuntimeConfig
from duplexpipe.runtime.backend import default_device
from duplexpipe.runtime.memory import optimizer_bytes
from duplexpipe.schedules.ir import Schedule
from duplexpipe.schedules.shard import add_unshard_reshard
from duplexpipe.schedules.timeline import Span
from duplexpipe.tp.parallelize import TensorParallel, check_tensor_parallel
from duplexpipe.tp.plans import TPPlan
from duplexpipe.train.compile import CompiledStages
from duplexpipe.train.experts import Experts
from duplexpipe.train.float8 import convert_stages, float8_options, float8_tp_styles, precompute_scales
from duplexpipe.train.pipeline_config import (
    AUTO,
    DataParallelConfig,
    LossFn,
    PipelineConfig,
    SchedulerFactory,
    StepInfo,
    runtime_config,
    with_defaults,
)
from duplexpipe.train.planning import PlannedPipeline, plan_pipeline
from duplexpipe.train.planning.auto import resolve_schedule, resolved
from duplexpipe.train.planning.choice import AutoChoice, RunPlan
from duplexpipe.train.precision import DynamicLossScaler

AUTO_PARTS_PER_RANK = 4
"""schedule="auto" in from_layers: the layers are profiled as up to this many parts per pipeline rank, which the
planner merges into its winner's model parts (finer parts balance better; each costs a little profiling)."""
BatchTransform = Callable[[Any, Any, bool], tuple[Any, Any]]
"""transform(inputs, targets, train) -> (inputs, targets): what `step` (train=True) and `evaluate` run on a batch
first (e.g. Hugging Face labels -> token-weighted targets)."""


def _batch_size(inputs: Any, targets: Any) -> int | None:
    """Rows of the inputs (or targets): dim 0 of the first leaf of a tensor, tuple/list or dict."""
    for value in (inputs, targets):
        leaves = list(value.values()) if isinstance(value, dict) else value
        if isinstance(leaves, (tuple, list)):
            leaves = leaves[0] if leaves else None
        if isinstance(leaves, torch.Tensor) and leaves.dim() > 0:
            return int(leaves.shape[0])
    return None


def _with_residency(schedule: Schedule, dp: DataParallelConfig, dp_size: int, window: int) -> Schedule:
    """The schedule the runtime runs: with zero_stage=3 over a data-parallel group, `schedule` with ZeRO-3's
    UNSHARD / RESHARD / REDUCE_GRAD (added by `add_unshard_reshard`, or a schedule's own, e.g. a file's, as they
    are); otherwise `schedule`, which must hold none (ValueError naming them)."""
    zero3 = dp.zero_stage == 3 and dp_size > 1
    held = sorted({a.op.value for row in schedule.actions for a in row if a.op.is_fsdp})
    if held and not zero3:
        raise ValueError(f"schedule {schedule.name!r} holds ZeRO-3's {'/'.join(held)} actions, which run only with "
                         f"zero_stage=3 and a data-parallel group (this pipeline: zero_stage={dp.zero_stage or 0}, "
                         f"dp={dp_size}); set DataParallelConfig(zero_stage=3) on a mesh with dp >= 2, or run "
                         "schedule.without_fsdp()")
    if not zero3:
        return schedule
    if held:
        if dp.reshard_window is not None:
            raise ValueError(f"schedule {schedule.name!r} already holds UNSHARD/RESHARD/REDUCE_GRAD actions (its own "
                             f"residency), so reshard_window={dp.reshard_window} cannot apply; leave it None or run "
                             "schedule.without_fsdp()")
        return schedule
    return add_unshard_reshard(schedule, window, dp.unshard_lookahead, dp_size, dp.reshard_gradients)



def _partition_on_rank0(plan: Callable[[], Partition]) -> Partition:
    """`plan()` run on rank 0 alone, once every rank is ready, and its partition (or its error) given to every rank:
    profiled times differ per process, and ranks that profiled at once on shared cores timed each other's start-up
    (the first layers timed came out several times slower)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return plan()
    dist.barrier()
    shared: list[Any] = [None]
    failed: Exception | None = None
    if dist.get_rank() == 0:
        try:
            shared[0] = plan()
        except Exception as exc:  # every rank raises, none waits for a partition that never comes
            failed = exc
            shared[0] = (type(exc) if type(exc) in (ValueError, TypeError) else PipelineError, str(exc))
    dist.broadcast_object_list(shared, src=0)
    if failed is not None:
        raise failed
    if isinstance(shared[0], tuple):
        kind, message = shared[0]
        raise kind(message)
    return shared[0]


class Pipeline:
    """Trains model parts with a pipeline schedule on this process's pipeline rank.

    `parts` are the model parts, built the same way on every rank (same seed or state_dict): the
    pipeline deep-copies the parts its stages need. To build only this rank's parts, pass parts
    on the meta device with `init(part, k)`, or a factory `parts(k) -> nn.Module` (see
    `stages.build_stage_modules`). `scheduler(optimizer)` builds an LR scheduler stepped after
    every applied optimizer step (not after skipped fp16 steps). With a DeviceMesh ("pp", "dp") each
    data-parallel replica passes its own batch and gradients are averaged over replicas
    after the schedule's own DualPipe mirror sum, by the data-parallel strategy `self.dp`
    (bucket by bucket, each started as soon as its gradients are final; compressed when
    `config.data_parallel.grad_compression` says so). With a mesh of tp > 1 (`make_mesh(pp, dp, tp=...)`), `tp_plan`
    shards every stage module over the mesh's "tp" sub-mesh (see `tp.parallelize` and `tp.plans`; with
    `config.sequence_parallel` the plan keeps the sequence sharded between TP regions and across stages);
    `self.param_bytes` is what this rank holds.

    `config` is a PipelineConfig with a named or given schedule, or the plan `plan_pipeline` made for these parts
    and this mesh: with schedule="auto" planning is a step before construction (`duplexpipe.plan_pipeline(parts,
    loss_fn, optimizer, PipelineConfig("auto", memory_limit=...), mesh=..., sample_input=..., sample_targets=...)`
    measures, plans and logs the choice; `Pipeline(parts, loss_fn, optimizer, plan, mesh=...)` merges the parts as
    the plan says and builds). `from_layers` and `from_pretrained` take schedule="auto" and plan first themselves.
    The constructor builds only: it measures and plans nothing. `self.plan` says what runs (any schedule),
    `self.auto` holds the planner's whole result.
    """

    def __init__(
        self,
        parts: PartSource,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        config: PipelineConfig | PlannedPipeline | None = None,
        *,
        mesh: DeviceMesh | None = None,
        device: torch.device | str | None = None,
        partition: Partition | None = None,
        init: PartInit | None = None,
        scheduler: SchedulerFactory | None = None,
        tp_plan: TPPlan | None = None,
    ) -> None:
        self.groups = groups = ParallelGroups.from_mesh(mesh)
        planned = config if isinstance(config, PlannedPipeline) else resolved(config or PipelineConfig(), groups)
        sizes = (groups.pp_size, groups.dp_size, groups.tp_size)
        if planned.sizes != sizes:
            raise ValueError(f"the plan was made for a mesh of (pp, dp, tp) = {planned.sizes}, but this one is {sizes}")
        check_tensor_parallel(parts, tp_plan, groups, planned.config.sequence_parallel)
        self.device = torch.device(device) if device is not None else default_device()
        parts, init = planned.merged_parts(parts), planned.merged_init(init)
        partition = planned.merged_partition(partition)
        self.config = cfg = planned.config
        """The config this pipeline runs (with "auto": the planner's M, ZeRO stage and compression set)."""
        self.auto: AutoChoice | None = planned.auto
        """schedule="auto": the plan that was chosen (its table: `auto.result.table()`); None otherwise."""
        self.schedule = planned.schedule
        self.plan: RunPlan = planned.plan
        """What runs: schedule, M, ZeRO stage and gradient compression (with "auto": the planner's choice)."""
        self.partition = partition.placed(self.schedule) if partition is not None else None
        ckpt = resolve_checkpointing(cfg.activation_checkpointing, self.schedule)
        self.stage_modules = self._build_stages(parts, init, ckpt)
        float8 = float8_options(cfg.precision.float8)
        styles = float8_tp_styles(tp_plan, groups.tp_size, groups.tp_group) if float8 is not None else None
        self.tensor = TensorParallel(tp_plan, groups, cfg.sequence_parallel, styles)
        """Tensor parallelism inside this rank's stages (inactive without a plan or with tp=1)."""
        self.tensor.apply({s: model_parts(m) for s, m in self.stage_modules.items()}, cfg.data_parallel.zero_stage or 0)
        if float8 is not None and self.tensor.active:
            from duplexpipe.train.float8_tp import log_styles

            log_styles(styles, callable_plan=styles is None)
        self.experts = Experts(self.stage_modules, self.schedule, groups, ckpt, self.device)
        """This rank's MoE layers: expert parallelism and the expert-bias update."""
        self.params = [p for s in sorted(self.stage_modules) for p in self.stage_modules[s].parameters()]
        window = check_window(cfg.data_parallel.reshard_window, len(self.stage_modules), groups.pp_rank)
        self.tied = self._tie(parts)
        self.scaler = DynamicLossScaler(cfg.precision.loss_scale, enabled=cfg.precision.dtype == "fp16")
        self.p2p_meter = WireMeter()
        """Every stage-to-stage SEND of this rank: kind "send", its payload bytes on the wire."""
        # ZeRO-3: the runtime runs the schedule with UNSHARD / RESHARD / REDUCE_GRAD per stage (schedules.shard)
        sharded = _with_residency(self.schedule, cfg.data_parallel, groups.dp_size, window)
        self.runtime = PipelineRuntime(sharded, self.stage_modules, loss_fn, group=groups.pp_group,
                                       device=self.device, config=self._runtime_config(),
                                       activation_offload=self.config.activation_offload,
                                       job_group=dist.group.WORLD if groups.dp_size * groups.tp_size > 1 else None)
        if cfg.safety.check_replicas:  # before the strategy (ZeRO-2 turns the parameters into shards) and the experts'
            self._check_replicas()  # sharding (the replicas of an expert-parallel group then hold different ones)
        self.dp: DPStrategy = self._strategy(optimizer, self.experts.shard())
        """The data-parallel strategy: reduce -> overflow check -> clip -> optimizer step."""
        if isinstance(self.dp, Zero3Strategy):  # the schedule's residency actions drive FSDP2
            self.dp.follow(sharded)
            self.runtime.drive_residency(self.dp)
        self.links = self._link_adapter()
        """p2p_compression="adaptive": the controller of this pipeline's stage links (None otherwise)."""
        self.params = self.dp.params
        self.dp.counted = self.tied.counted(self.dp.counted)  # a tied weight counts once in the norm
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        """The LR scheduler (None without one); stepped after every applied optimizer step."""
        self.compiled = CompiledStages(self.stage_modules, cfg.compile, self.schedule, self.device, parts)  # last
        self._start_counting()

    def _build_stages(self, parts: PartSource, init: PartInit | None, ckpt: Checkpointing) -> dict[int, nn.Module]:
        """This rank's stage modules, checkpointed where `ckpt` says and float8-converted where the config asks
        (before TP, ZeRO and compile wrap them)."""
        cfg = self.config
        modules = build_stage_modules(self.schedule, self.groups.pp_rank, parts, init=init, checkpoint_stages=ckpt,
                                      device=self.device)
        if (float8 := float8_options(cfg.precision.float8)) is not None:
            convert_stages(modules, float8, self.device, split=not cfg.compile,
                           zero_stage=cfg.data_parallel.zero_stage or 0)
        return modules

    def _tie(self, parts: PartSource) -> TiedGrads:
        """The weights the parts share across stages (factory parts cannot share a Parameter), checked against ZeRO
        and tensor parallelism."""
        tied = find_tied([] if callable(parts) else parts)
        check_tied(self.config.data_parallel.zero_stage or 0, [t.places for t in tied], self.groups.dp_size)
        out = TiedGrads(tied, self.schedule, self.groups.pp_rank, self.stage_modules, self.groups.pp_group)
        self.tensor.check_tied(out.layouts())
        return out

    def _start_counting(self) -> None:
        """The counters and hooks of a new pipeline."""
        self.optimizer_steps = 0
        """Optimizer steps taken (skipped fp16 steps not counted)."""
        self.calls = 0
        """Calls to `step` so far."""
        self.last: StepInfo | None = None
        self._window_calls = 0
        self._window_weight = 0.0
        self._window_unit: int | None = None
        self.batch_transform: BatchTransform | None = None
        """Run on every batch before `step` / `evaluate` (None: batches go in as given)."""
        self.source_dir: str | None = None
        """The Hugging Face model directory this pipeline was loaded from (`from_pretrained`), else None."""

    def _runtime_config(self) -> RuntimeConfig:
        """The runtime's settings from this pipeline's config."""
        return runtime_config(self.config, fb_overlap=self.experts.note_overlap(self.config.fb_overlap),
                              on_grads_ready=self._grads_ready, p2p_meter=self.p2p_meter)

    def _strategy(self, optimizer: OptimizerFactory, experts: frozenset[int]) -> DPStrategy:
        """The data-parallel strategy the config asks for, over this rank's stages in the order they finish."""
        dp, plan = self.config.data_parallel, self.runtime.plan
        return make_strategy(StrategyContext(
            self.stage_modules, self.schedule, tuple(final_order(plan.grads_final, plan.mirrored)), self.groups,
            optimizer, self.device, self.bounded, compression_options(dp.grad_compression),
            dp.grad_bucket_bytes, dp.zero_stage or 0, dp.zero, experts), dp.dp_strategy)

    @classmethod
    def from_layers(
        cls,
        layers: nn.Sequential | Sequence[nn.Module],
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        config: PipelineConfig | None = None,
        *,
        embedding: nn.Module | None = None,
        head: nn.Module | None = None,
        balance: Balance = "uniform",
        sample_input: Any = None,
        mesh: DeviceMesh | None = None,
        device: torch.device | str | None = None,
        init: PartInit | None = None,
        scheduler: SchedulerFactory | None = None,
        sample_targets: Any = None,
        tp_plan: TPPlan | None = None,
    ) -> Pipeline:
        """Split `layers` (plus optional embedding/head) into the schedule's model parts and build.

        `balance` and `sample_input` are as in `split.plan_partition`; rank 0's partition is used
        on every rank (profiled times differ between processes). Layers on the meta device need
        `init` (this rank's parts are allocated and filled, no other part is). With schedule="auto"
        the layers are split into 4P parts (one per layer when there are fewer), `sample_input` and
        `sample_targets` are a batch as given to `step`, and the planner merges parts as its
        winner needs. `tp_plan` applies to the parts (children `embedding`, `layer<i>`, `head`), e.g.
        `launch.tasks.gpt.gpt_tp_plan` or `moe.moe_tp_plan`. schedule="auto" is planned here (`plan_pipeline`), on
        the parts, before the Pipeline is built.
        """
        config = config or PipelineConfig()
        pp = ParallelGroups.from_mesh(mesh).pp_size
        blocks = as_layers(layers)
        num_parts = min(len(blocks), AUTO_PARTS_PER_RANK * pp) if config.schedule == AUTO else \
            resolve_schedule(with_defaults(config), pp).num_groups
        timed = config.schedule != AUTO or balance == "time"  # auto profiles the parts itself
        partition = _partition_on_rank0(functools.partial(
            plan_partition, blocks, num_parts, balance, embedding=embedding, head=head,
            sample_input=sample_input if timed else None))
        parts = build_parts(blocks, partition, embedding=embedding, head=head)
        plan = plan_pipeline(parts, loss_fn, optimizer, config, mesh=mesh, device=device, init=init,
                             sample_input=sample_input, sample_targets=sample_targets, tp_plan=tp_plan)
        return cls(parts, loss_fn, optimizer, plan, mesh=mesh, device=device, partition=partition, init=init,
                   scheduler=scheduler, tp_plan=tp_plan)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the data-parallel strategy steps (built from the `optimizer` factory)."""
        return self.dp.optimizer

    def _grads_ready(self, stage: int) -> None:
        if self.dp.final:
            self.tensor.grads_final(stage, self.stage_modules, self.bounded)
        self.dp.grads_ready(stage)

    def bounded(self, work: Any, what: str) -> None:
        """Wait for a collective posted with async_op=True, bounded by the timeout and stopped (with an
        error naming the failed rank) when any rank of the job failed; see PipelineRuntime.bounded."""
        self.runtime.bounded(work, what, "all ranks of the job")

    def _check_replicas(self) -> None:
        mine = {s: fingerprint(m) for s, m in self.stage_modules.items()}
        gathered = [mine]
        if dist.is_available() and dist.is_initialized():
            table = torch.full((self.schedule.num_stages,), -1, dtype=torch.int64)
            for stage, fp in mine.items():
                table[stage] = int(fp[:15], 16)
            table = table.to(self.device)
            everyone = [torch.empty_like(table) for _ in range(dist.get_world_size())]
            self.bounded(dist.all_gather(everyone, table, async_op=True), "the model-replica check")
            gathered = [{s: f"{v:015x}" for s, v in enumerate(t.tolist()) if v >= 0} for t in everyone]
        tp = self.groups.tp_size  # TP ranks hold different shards: compare ranks of one TP coordinate (rank % tp)
        bad = [b for t in range(tp) for b in find_mismatched_copies(self.schedule, gathered[t::tp])]
        if bad:
            desc = "; ".join(f"part {g}: " + ", ".join(f"stage {s}={fp[:8]}" for s, fp in copies)
                             for g, copies in bad)
            raise ValueError(
                f"copies of a model part start with different weights ({desc}); build the model from "
                "the same seed or state_dict on every rank"
            )

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameters this rank holds in its stage modules (under tensor parallelism or ZeRO-2 its
        local shards; DualPipe's two copies of a part both count)."""
        return self.tensor.param_bytes(self.stage_modules)

    @property
    def window_calls(self) -> int:
        """Calls made in the current accumulation window (0 right after an optimizer step)."""
        return self._window_calls

    @property
    def stage_state_modules(self) -> dict[int, nn.Module]:
        """This rank's stage modules without activation-checkpointing wrappers."""
        return {s: inner_module(m) for s, m in self.stage_modules.items()}

    def step(self, inputs: Any, targets: Any) -> float:
        """Run one pipelined forward+backward over the batch; step the optimizer at window ends.

        Returns the batch's mean loss (the same on every rank). Details are in `self.last`. The first step with
        compiled stages waits up to `compile_timeout_s` instead of `timeout_s`.
        """
        with self.compiled.patience("step", self.runtime.watchdog, self.config.safety.compile_timeout_s):
            return self._step(inputs, targets)

    def _step(self, inputs: Any, targets: Any) -> float:
        """`step`."""
        cfg = self.config
        began = time.perf_counter()
        if self.batch_transform is not None:
            inputs, targets = self.batch_transform(inputs, targets, True)
        if self._window_calls == 0:
            self.dp.zero_grad()
        weight = self._call_weight(inputs, targets)
        scale = self.scaler.scale
        final = self._window_calls + 1 == cfg.accumulation_steps
        if final:
            self.tensor.begin_window()
        self.dp.begin_call(final, scale * (self._window_weight + weight))
        wire = self.dp.meter.total_bytes
        self.runtime.transport.reset_waits()
        observe = cfg.observe  # with record_tp_lane: the TP collectives on the timeline's "tp" lane
        optimizer_during = optimizer_bytes(self.optimizer) if observe.measure_memory else 0
        with (self.compiled.watching(f"step {self.calls}"),
              self.tensor.timed(observe.record_timeline and observe.record_tp_lane)):
            result = self.runtime.step(inputs, targets, loss_scale=scale * weight)
        self.calls += 1
        self._window_calls += 1
        self._window_weight += weight
        applied, skipped, norm = False, False, None
        try:
            loss = result.loss  # one all-reduce over the job: the mean over data-parallel replicas
            self.dp.note_loss(loss)
            if self._window_calls == cfg.accumulation_steps:
                skipped, norm = self._apply()
                applied = not skipped
        except NonFiniteGradientError:  # every rank raises it at the same point: nobody waits
            raise
        except BaseException as exc:  # the other ranks wait in collectives: tell them
            self.runtime.report_failure(exc)
            raise
        timeline, origin, rank = result.timeline, self.runtime.origin, self.runtime.rank
        if timeline is not None:
            links = tuple(Span(rank, EXPOSED_LANE, f"link {peer}->{rank}", b - origin, e - origin)
                          for peer, b, e in self.runtime.transport.recv_waits)
            timeline = replace(timeline, spans=timeline.spans + tuple(self.tensor.spans(origin, rank)) + tuple(
                self.dp.spans(origin, rank) if final else ()) + links)
        exposure = self._exposure(final)
        compression = merged_reports(self.dp.report if final else None,
                                     self._adapt_links(exposure, time.perf_counter() - began, loss))
        memory = result.memory
        if memory is not None:  # the optimizer state held while the actions ran, and after the optimizer step
            memory = memory.with_optimizer(optimizer_during, optimizer_bytes(self.optimizer))
        self.last = StepInfo(loss, applied, skipped, norm, scale, timeline, self.dp.meter.total_bytes - wire,
                             result.peak_saved_bytes, memory, exposure, compression)
        return loss

    def _link_adapter(self) -> LinkAdapter | None:
        """The stage links' controller, over a process group of this pipeline's ranks of its own (collective)."""
        codec = self.runtime.mail.activation_codec
        if not isinstance(codec, AdaptiveCodec):
            return None
        self.runtime.transport.stamp_sends = True  # the exposed time beyond the sender's compute (alike everywhere)
        layout = self.runtime.plan.layout
        links = [pair for s, n in enumerate(layout.nxt) if n >= 0 and layout.rank[s] != layout.rank[n]
                 for pair in ((layout.rank[s], layout.rank[n]), (layout.rank[n], layout.rank[s]))]
        return LinkAdapter(codec, links, own_group(self.groups.pp_group, self.device, self.bounded))

    def _adapt_links(self, exposure: ExposureReport, step_s: float, loss: float) -> CompressionReport | None:
        """Adaptive stage sends: settle the last agreement (new rungs from the next call) and post this call's."""
        if self.links is None:
            return None
        return self.links.finish_step(dict(exposure.links), step_s, loss, self.device, self.bounded)

    def _exposure(self, final: bool) -> ExposureReport:
        """The call's exposed communication: bucket waits (window ends) and receive waits per stage link."""
        me = self.runtime.rank
        links: dict[str, float] = {}
        for peer, begin, end in self.runtime.transport.recv_waits:
            key = f"link {peer}->{me}"
            links[key] = links.get(key, 0.0) + (end - begin)
        return ExposureReport(dict(self.dp.exposed_s) if final else {}, links)

    def _call_weight(self, inputs: Any, targets: Any) -> float:
        """This call's weight in the window: its batch size over the window's first batch size."""
        if self.config.accumulation_steps == 1:
            return 1.0
        size = _batch_size(inputs, targets)
        if size is None:
            raise ValueError("with accumulation_steps > 1 pass inputs or targets on every rank "
                             "(their batch size weights the accumulated gradient)")
        if self._window_unit is None or self._window_calls == 0:
            self._window_unit = size
        return size / self._window_unit

    def _apply(self) -> tuple[bool, float | None]:
        """End the window through the strategy: wait for the reductions, sum tied weights, norm + overflow
        check, then skip (fp16 overflow) or unscale + clip + optimizer step (+ LR scheduler step)."""
        cfg = self.config
        self._window_calls, self._window_weight = 0, 0.0
        self.tensor.finish(self.stage_modules, self.bounded)
        self.dp.finish()
        self.tied.sum_grads(wait=self.bounded)  # weights shared by several parts (tied embeddings)
        norm, overflow = self.dp.norm_and_overflow(True)  # every step: NaN/inf never trains (train/nonfinite.py)
        if overflow:
            error = self._nonfinite(norm) if not self.scaler.enabled and cfg.safety.nonfinite_grads == "raise" else None
            self.dp.skip()
            self.experts.after_step(applied=False, wait=self.bounded)
            if error is not None:
                raise error  # on every rank alike (the verdict is shared); the pipeline stays usable
            self.scaler.update(overflow=True)
            return True, norm
        self.dp.step(grads.clip_factor(norm or 0.0, cfg.grad_clip_norm))
        if cfg.precision.float8 is not None:  # the scales of ZeRO-3's next float8 all-gathers (none otherwise)
            precompute_scales(self.stage_modules.values())
        self.experts.after_step(applied=True, wait=self.bounded)
        if self.scheduler is not None:
            self.scheduler.step()
        self.scaler.update(overflow=False)
        self.optimizer_steps += 1
        return False, norm

    def _nonfinite(self, norm: float | None) -> Exception:
        """The NonFiniteGradientError of this step, naming the first stage and parameter (collective)."""
        from duplexpipe.train.checkpoint import state_keys
        from duplexpipe.train.nonfinite import located, nonfinite_error

        return nonfinite_error(self.calls, norm, located(self.stage_state_modules, state_keys(self).names))

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because the gradients held NaN or inf (fp16 overflows, nonfinite_grads="skip")."""
        return self.scaler.skipped_steps

    def evaluate(self, inputs: Any, targets: Any = None) -> EvalResult:
        """Forward only, in eval mode (dropout off, no autograd).

        Returns the runtime's EvalResult: the whole batch's outputs in batch order on ranks
        holding a last stage (None elsewhere), and the mean loss on every rank when targets are given. With
        zero_stage=3 the parameters are sharded again afterwards (as between steps).
        """
        if self.batch_transform is not None and targets is not None:
            inputs, targets = self.batch_transform(inputs, targets, False)
        modes = {s: m.training for s, m in self.stage_modules.items()}
        for m in self.stage_modules.values():
            m.eval()
        try:
            with (torch.no_grad(), self.compiled.watching("evaluate"),
                  self.compiled.patience("evaluate", self.runtime.watchdog, self.config.safety.compile_timeout_s)):
                return self.runtime.evaluate(inputs, targets)
        finally:
            for s, m in self.stage_modules.items():
                m.train(modes[s])
            if isinstance(self.dp, Zero3Strategy):  # FSDP gathered each stage at its first forward: shard it again
                self.dp.reshard()

    def save(self, path: str) -> None:
        """Save parameters and optimizer state under the model's own names, and the trainer state, with
        torch.distributed.checkpoint (collective). See `train.checkpoint`."""
        from duplexpipe.train.checkpoint import save_checkpoint

        save_checkpoint(self, path)

    def load(self, path: str) -> None:
        """Load what `save` wrote (collective), into this or any other layout (schedule, pipeline size,
        partition, data-parallel size, ZeRO stage); training continues exactly where it stopped."""
        from duplexpipe.train.checkpoint import load_checkpoint

        load_checkpoint(self, path)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        optimizer: OptimizerFactory,
        config: PipelineConfig | None = None,
        *,
        mesh: DeviceMesh | None = None,
        balance: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        scheduler: SchedulerFactory | None = None,
        sample_input: Any = None,
        sample_targets: Any = None,
        router_bias_update_speed: float = 0.0,
        tp_plan: TPPlan | None = None,
    ) -> Pipeline:
        """A pipeline of a Hugging Face causal LM directory (Llama, Mistral, Qwen2, Qwen3, GPT-2; the MoE families
        Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 with expert parallelism; safetensors).

        Each rank builds the model on the meta device and reads only its own parts' tensors from the files
        (sharded checkpoints too); `dtype` None keeps the checkpoint's. Layers are spread evenly or by `balance`
        (layers per model part). `step(input_ids, labels)` (labels unshifted, -100 ignored; inputs may be a dict
        with `attention_mask` / `position_ids`) returns transformers' loss of the whole batch: every counted
        token weighs the same across microbatches and data-parallel replicas. With schedule="auto", rank 0
        materialises every part once to profile it. MoE models: with a ("pp", "edp", "ep") mesh each rank reads
        only its own experts; `router_bias_update_speed` turns on DeepSeek-V3's aux-loss-free balance (its expert
        bias moves after each optimizer step); transformers' aux loss follows the config (output_router_logits).
        With a mesh of tp > 1 the model's published tensor-parallel plan is applied (`model.hf_tp.HFTensorPlan`,
        with `config.sequence_parallel`) unless `tp_plan` is given. Raises ValueError for a directory it cannot load.
        """
        from duplexpipe.model.hf import causal_lm_loss
        from duplexpipe.train.pretrained import PretrainedModel, TokenWeighted, expert_layout

        config = config or PipelineConfig()
        source = PretrainedModel.open(path, dtype)
        groups = ParallelGroups.from_mesh(mesh)
        pp = groups.pp_size
        num_parts = min(source.num_layers, 2 * pp) if config.schedule == AUTO else \
            resolve_schedule(config, pp).num_groups
        parts = source.parts(num_parts, balance, experts=None if config.schedule == AUTO else expert_layout(mesh),
                             bias_update_speed=router_bias_update_speed)
        if tp_plan is None and groups.tp_size > 1:
            from duplexpipe.model.hf_tp import HFTensorPlan

            tp_plan = HFTensorPlan(config.sequence_parallel)
        plan = plan_pipeline(parts, causal_lm_loss, optimizer, config, mesh=mesh, device=device, init=source.fill,
                             sample_input=sample_input, sample_targets=sample_targets, tp_plan=tp_plan)
        pipe = cls(parts, causal_lm_loss, optimizer, plan, mesh=mesh, device=device, init=source.fill,
                   partition=source.partition(parts, balance is not None), scheduler=scheduler, tp_plan=tp_plan)
        pipe.source_dir = str(path)
        pipe.batch_transform = TokenWeighted(pipe.groups.dp_group, pipe.groups.dp_size, pipe.device, pipe.bounded)
        return pipe

    def save_pretrained(self, path: str | Path, overwrite: bool = False) -> None:
        """Write a Hugging Face model directory that `AutoModelForCausalLM.from_pretrained(path)` loads as is
        (collective): config.json, one safetensors shard per pipeline rank and their index, tied weights once, and
        the source directory's tokenizer and generation files. Needs Hugging Face parts. Written into a new folder
        and swapped in whole (a failure leaves `path` as it was); the folder the model was loaded from is refused
        unless `overwrite`."""
        from duplexpipe.train.checkpoint import save_pretrained

        save_pretrained(self, str(path), overwrite)


