"""ZeRO-3 through torch FSDP2 driven by the schedule: parameters sharded at rest, gathered per residency episode.

The stage modules are fully_shard-ed as for ZeRO-2 (zero2.py: same units, same ShardComm collectives, same
gradient handling), but nothing is left gathered between steps: the schedule's UNSHARD action of a stage posts
FSDP's all-gather (`unshard(async_op=True)`; the collective stays in flight on ShardComm), which is waited for and
copied out right before the stage's next compute; RESHARD frees the gathered parameters (`reshard()`); REDUCE_GRAD
runs FSDP's post-backward by hand (the reduce-scatter) once the stage's gradients are final, as
torch.distributed.pipelining's schedules do. A stage's routed experts, sharded over their expert-data-parallel
group (zero2.py), are gathered, freed and reduced with it. Between a stage's episodes its unreduced gradients stay
on FSDP's unsharded parameters, whose storage only is freed.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from duplexpipe.parallel.strategy import StrategyContext
from duplexpipe.parallel.zero2 import Zero2Strategy, _fsdp_params


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

    def _stage_units(self, stage: int) -> list[Any]:
        """`stage`'s FSDP units: its module, then its expert units."""
        return [self.ctx.modules[stage], *self.expert_units.get(stage, [])]

    def wait_unshard(self, stage: int) -> None:
        """Before a compute of `stage`: finish its posted all-gathers (bounded wait) and let FSDP copy them out."""
        handles = self.handles.pop(stage, None)
        if not handles:
            return
        for pending in self.comms.gathering.pop(stage, []):
            pending.finish(self.ctx.wait)
        for handle in handles:
            handle.wait()

    def reshard_stage(self, stage: int) -> None:
        """RESHARD: free `stage`'s gathered parameters and experts (the unreduced gradients stay on FSDP's
        records)."""
        self.wait_unshard(stage)
        for unit in self._stage_units(stage):
            unit.reshard()

    def reduce_grad(self, stage: int) -> None:
        """REDUCE_GRAD: on a window-ending call, reduce-scatter `stage`'s gradients (mirrored stages: after the
        mirror sum, see grads_ready)."""
        if stage not in self.mirrored:
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
        holders = [r._unsharded_param for unit in self._stage_units(stage) for r in _fsdp_params(unit)
                   if hasattr(r, "_unsharded_param")]
        whole = [] if stage in self.expert_units else [p for p in module.parameters() if id(p) in self.ctx.experts]
        return [p for p in holders if p.requires_grad] + whole

    def finish(self) -> None:
        """Finish the step's reductions; every stage is sharded again afterwards (at rest: 1/DP bytes)."""
        super().finish()
        if self.final:
            self.reshard()

    def unsharded_bytes(self) -> int:
        """Bytes of parameters this rank holds gathered now, experts included (what ZeRO-3's window bounds)."""
        total = 0
        for module in self.units:
            for record in _fsdp_params(module):
                if record.sharded_state.name == "UNSHARDED":
                    total += record._unsharded_param.numel() * record._unsharded_param.element_size()
        return total

