"""ZeRO-3 through torch FSDP2 driven by the schedule: parameters sharded at rest, gathered per residency episode.

The stage modules are fully_shard-ed as for ZeRO-2 (zero2.py: same units, same ShardComm collectives, same
gradient handling), but nothing is left gathered between steps: the schedule's UNSHARD action of a stage posts
FSDP's all-gather (`unshard(async_op=True)`; the collective stays in flight on ShardComm), which is waited for and
copied out right before the stage's next compute; RESHARD frees the gathered parameters (`reshard()`); REDUCE_GRAD
runs FSDP's post-backward by hand (the reduce-scatter). With a window holding all of a rank's stages there is one
per stage, once its gradients are final, as torch.distributed.pipelining's schedules do; with a smaller window the
pass puts one after each episode with a B or W: it reduce-scatters what the episode accumulated, FSDP adds it into
the stage's sharded gradient and drops the unsharded one, so the next episode accumulates from zero and the
optimizer sees the sum of every reduction (in every call of an accumulation window; qgZ rounds each reduction
apart). A stage's routed experts, sharded over their expert-data-parallel group (zero2.py), are gathered, freed and
reduced with it. Between a stage's episodes any unreduced gradients stay on FSDP's unsharded parameters, whose
storage only is freed.

hpZ (ZeroOptions.hpz_ranks=k) uses FSDP2's post-forward mesh (`fully_shard(reshard_after_forward=k)`: groups of k
consecutive data-parallel ranks) as the node-local secondary partition: FSDP's own post-forward reshard is kept
off (the schedule decides), a stage's RESHARD that another episode of the call follows reshards to that mesh
(FSDP's SHARDED_POST_FORWARD state, 1/k of the parameters per rank), so the call's later UNSHARDs of the stage
gather inside the k ranks and only its first crosses them; the stage's last RESHARD of the call shards it over the
whole group again, freeing the secondary copy (at rest: 1/DP). Its experts' units have no secondary partition: they
are resharded over their group at every RESHARD.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import Tensor

from duplexpipe.parallel.strategy import StrategyContext
from duplexpipe.parallel.zero2 import Zero2Strategy, sync_off
from duplexpipe.runtime.backward.compat import (
    free_post_forward,
    fsdp_held,
    fsdp_records,
    post_forward_bytes,
    reshard_post_forward,
    settle_post_forward,
    take_post_forward_meshes,
)
from duplexpipe.runtime.saved_bytes import storage_key
from duplexpipe.schedules.ir import Op, Schedule


class Zero3Strategy(Zero2Strategy):
    """Parameters, gradients and optimizer states sharded (FSDP2 over the data-parallel group); each stage's
    parameters are gathered at its UNSHARD actions and freed at its RESHARD actions."""

    name = "zero3"

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.handles: dict[int, list[Any]] = {}
        """Stage -> FSDP's unshard handles (its unit's and its expert units') of an UNSHARD not yet waited for."""
        stages = ctx.schedule.stages
        self.mirrored = frozenset(s for s in ctx.modules if any(
            o != s and info.group == stages[s].group and info.rank != stages[s].rank
            for o, info in enumerate(stages)))
        """This rank's stages whose gradients are final only after the mirror sum (reduced there, not at
        REDUCE_GRAD)."""
        self.secondary: dict[int, list[tuple[Any, Any]]] = (
            {s: take_post_forward_meshes(m) for s, m in ctx.modules.items()} if ctx.zero.hpz_ranks else {})
        """hpZ: stage -> its FSDP2 parameter groups, each with its node-local (post-forward) mesh."""
        self.reshards: dict[int, int] = {}
        """hpZ: stage -> RESHARD actions per call in the list the runtime runs (`follow`)."""
        self.resharded: Counter[int] = Counter()
        """hpZ: stage -> RESHARD actions run so far in this call."""
        self.per_call: dict[int, int] = {}
        """Stage -> REDUCE_GRAD actions per call in the list the runtime runs (`follow`): more than one, a window
        smaller than the rank's stages reduces after each episode."""
        self.reduced: Counter[int] = Counter()
        """Stage -> REDUCE_GRAD actions run so far in this call."""

    def follow(self, schedule: Schedule) -> None:
        """The list the runtime runs, with its RESHARD actions: under hpZ each stage's last RESHARD of a call shards
        it over the whole group, the earlier ones over its node-local group."""
        self.reshards = dict(Counter(a.stage for row in schedule.actions for a in row
                                     if a.op is Op.RESHARD and a.stage in self.ctx.modules))
        self.per_call = dict(Counter(a.stage for row in schedule.actions for a in row
                                     if a.op is Op.REDUCE_GRAD and a.stage in self.ctx.modules))

    def begin_call(self, final: bool, divisor: float) -> None:
        """As ZeRO-2; the call's RESHARDs and REDUCE_GRADs are counted afresh."""
        super().begin_call(final, divisor)
        self.resharded.clear()
        self.reduced.clear()

    def unshard_stage(self, stage: int) -> None:
        """UNSHARD: post the all-gathers of `stage` and of its experts (sharded over their expert-data-parallel
        group); they stay in flight until the stage's next compute."""
        comms = self.comms
        comms.defer_gathers = True
        try:
            handles = [unit.unshard(async_op=True) for unit in self._stage_units(stage)]
        finally:
            comms.defer_gathers = False
        self.handles[stage] = [h for h in handles if h is not None]

    def wait_unshard(self, stage: int) -> None:
        """Before a compute of `stage`: finish its posted all-gathers (bounded wait) and let FSDP copy them out."""
        handles = self.handles.pop(stage, None)
        if not handles:
            return
        for pending in self.comms.gathering.pop(stage, []):
            pending.finish(self.ctx.wait)
        for handle in handles:
            handle.wait()
        for group, _ in self.secondary.get(stage, ()):
            settle_post_forward(group)  # gathered: FSDP's post-forward hook must not reshard it

    def reshard_stage(self, stage: int) -> None:
        """RESHARD: free `stage`'s gathered parameters and experts (the unreduced gradients stay on FSDP's
        records); under hpZ keep the stage module's node-local secondary shard when another episode of the call
        follows."""
        self.wait_unshard(stage)
        self.resharded[stage] += 1
        units = self._stage_units(stage)
        if self.secondary.get(stage) and self.resharded[stage] < self.reshards.get(stage, 0):
            for group, mesh in self.secondary[stage]:
                reshard_post_forward(group, mesh)
            units = units[1:]  # the experts: no secondary partition
        for unit in units:
            unit.reshard()

    def reduce_grad(self, stage: int) -> None:
        """REDUCE_GRAD: reduce-scatter `stage`'s gradients. One per call: on a window-ending call only (the
        gradients accumulate unsharded until then). Several (windowed gradients): each adds what its episode
        accumulated into the sharded gradient and keeps the parameters gathered for the RESHARD that follows; the
        window-ending call's last one goes through the buckets like ZeRO-2's. Mirrored stages: after the mirror
        sum, see grads_ready."""
        if stage in self.mirrored:
            return
        self.reduced[stage] += 1
        if self.per_call.get(stage, 1) > 1 and not (self.final and self.reduced[stage] == self.per_call[stage]):
            self.reduce_stage(stage, reshard=False)
            sync_off(self.ctx.modules[stage])  # FSDP's own post-backward stays off for the stage's later backward
            return
        super().grads_ready(stage)

    def grads_ready(self, stage: int) -> None:
        """The runtime's final-gradient callback: only mirrored stages reduce here (the others at REDUCE_GRAD)."""
        if stage in self.mirrored:
            super().grads_ready(stage)

    def grad_holders(self, stage: int) -> list[Tensor]:
        """The tensors holding `stage`'s unreduced gradients in .grad: FSDP's unsharded parameters (their storage
        may be freed; the gradients are not) and its routed experts (outside FSDP), for the mirror sum; none of
        FSDP's before the stage's first all-gather."""
        module = self.ctx.modules[stage]
        holders = [r._unsharded_param for unit in self._stage_units(stage) for r in fsdp_records(unit)
                   if hasattr(r, "_unsharded_param")]
        whole = [] if stage in self.expert_units else [p for p in module.parameters() if id(p) in self.ctx.experts]
        return [p for p in holders if p.requires_grad] + whole

    def finish(self) -> None:
        """Finish the step's reductions; every stage is sharded again afterwards (at rest: 1/DP bytes)."""
        super().finish()
        self._free_secondary()
        if self.final:
            self.reshard()

    def reshard(self) -> None:
        """Every stage module sharded over the whole group, no hpZ secondary shard left."""
        super().reshard()
        self._free_secondary()

    def _free_secondary(self) -> None:
        """Free the hpZ secondary shards still held (none after a whole call: its last RESHARDs freed them)."""
        for groups in self.secondary.values():
            for group, _ in groups:
                if group.is_sharded_post_forward or post_forward_bytes(group):
                    free_post_forward(group)

    def secondary_bytes(self) -> int:
        """Bytes of hpZ secondary (node-local) shards this rank holds now."""
        return sum(post_forward_bytes(group) for groups in self.secondary.values() for group, _ in groups)

    def unsharded_bytes(self) -> int:
        """Bytes of parameters this rank holds gathered now, experts included (what ZeRO-3's window bounds; each
        gathered storage once, FSDP2's padding included, as the measured memory's `unsharded_params` counts them)."""
        held = fsdp_held([record for module in self.units for record in fsdp_records(module)])
        return sum(dict(storage_key(t) for t in held.unsharded).values())

