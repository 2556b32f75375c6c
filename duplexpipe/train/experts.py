"""MoE layers inside a Pipeline: experts spread over the expert-parallel group, exchanges named by stage,
the expert-bias update after each optimizer step."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.moe.balance import LoadSync, expert_parameters, moe_layers
from duplexpipe.moe.dispatch import ExpertGroup
from duplexpipe.parallel.mesh import ParallelGroups
from duplexpipe.runtime.backend import is_nccl
from duplexpipe.runtime.comm_points import Wait
from duplexpipe.schedules.ir import Op, Schedule

LOG = logging.getLogger("duplexpipe.moe")


class Experts:
    """This rank's MoE layers (if any) and what the Pipeline does with them."""

    def __init__(self, modules: Mapping[int, nn.Module], schedule: Schedule, groups: ParallelGroups,
                 checkpointing: Collection[int], device: torch.device) -> None:
        self.modules = modules
        self.schedule = schedule
        self.layers = {s: moe_layers(m) for s, m in modules.items()}
        self.present = any(self.layers.values())
        """This rank's stages hold MoE layers."""
        bad = sorted(s for s in checkpointing if self.layers.get(s))
        if bad:
            raise ValueError(f"activation_checkpointing on stage(s) {bad}, which hold MoE layers: recomputing "
                             "their forward would repeat the expert all-to-alls inside the backward; leave those "
                             "stages out of activation_checkpointing")
        for s, layers in self.layers.items():
            for j, layer in enumerate(layers):
                layer.label = f"stage {s} moe {j}"
        self.groups = groups
        self.device = device
        self.sync = LoadSync({schedule.stages[s].group: m for s, m in modules.items()}, None, device) \
            if dist.is_available() and dist.is_initialized() else None

    def shard(self) -> frozenset[int]:
        """Keep only this rank's experts (ep > 1); returns id() of the expert parameters left, which the
        data-parallel strategy reduces over the expert-data-parallel group (none with ep == 1: every replica
        holds every expert, so they reduce like any other parameter)."""
        ep = self.groups.ep_size
        if ep == 1:  # every replica holds every expert: they reduce with the other parameters
            return frozenset()
        if ep > 1:
            group = ExpertGroup(self.groups.ep_group, self.groups.ep_rank, ep)
            for layers in self.layers.values():
                for layer in layers:
                    layer.shard_experts(group)
            if is_nccl(self.groups.ep_group):  # NCCL: open the group's communicator now, not mid-step
                probe = torch.zeros(ep, device=self.device)
                dist.all_to_all_single(torch.empty_like(probe), probe, group=self.groups.ep_group)
        return frozenset(id(p) for m in self.modules.values() for p in expert_parameters(m))

    def note_overlap(self, fb_overlap: bool) -> bool:
        """Whether the runtime should interleave F&B pairs: MoE layers here, overlap asked for, and pairs in the
        schedule (said once in the log when there is nothing to overlap)."""
        pairs = any(a.op is Op.OVERLAP_F_B for row in self.schedule.actions for a in row)
        if fb_overlap and self.sync is not None and self.sync.layers and not pairs and dist.get_rank() == 0:
            LOG.info("fb_overlap: schedule %r has no F&B pairs; its MoE all-to-alls run where they are "
                     "(nothing to overlap)", self.schedule.name)
        return fb_overlap and self.present and pairs

    def after_step(self, applied: bool, wait: Wait) -> None:
        """After an optimizer step: update every expert bias from the step's loads summed over the job
        (collective), and start counting anew. A skipped step only forgets its counts."""
        if self.sync is None or not self.sync.layers:
            return
        copies = [(self.schedule.stages[s].group, m) for s, m in self.modules.items()]
        if applied:
            self.sync.update(copies, wait)
            return
        for _, module in copies:
            for layer in moe_layers(module):
                layer.reset_load()
