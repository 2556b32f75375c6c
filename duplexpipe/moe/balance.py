"""Keeping experts balanced across a job: the balance losses of a forward, and the expert-bias update from
the step's token counts summed over every rank that routed tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from duplexpipe.moe.layer import MoELayer
from duplexpipe.runtime.comm_points import CommSlot, Wait, forward_slot, plain_wait


@contextlib.contextmanager
def collect_losses() -> Iterator[list[Tensor]]:
    """Around a forward outside a pipeline (a one-process model): the loss terms its MoE layers add to the
    objective (their balance losses), to be added to the loss: `with collect_losses() as aux: ...;
    loss = task_loss + sum(aux)`. A Pipeline adds them by itself."""
    slot = CommSlot()
    with forward_slot(slot):
        yield slot.losses


def moe_layers(module: nn.Module) -> list[MoELayer]:
    """The MoE layers inside `module`, in module order."""
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters inside `module` (each held by one expert-parallel rank)."""
    return [p for layer in moe_layers(module) for p in layer.experts.parameters()]


def update_bias_locally(module: nn.Module) -> None:
    """One process (no pipeline): update every MoE layer's expert bias from its own counts, and reset them."""
    for layer in moe_layers(module):
        layer.update_bias(layer.load)
        layer.reset_load()


class LoadSync:
    """The step's expert loads of every MoE layer of the model, summed over the job, for the bias update.

    Layer j of model part k is the same layer on every rank holding part k (data-parallel replicas, and
    DualPipe's two copies): each rank adds its counts into slot (k, j) of one vector and one all-reduce over
    the job sums them. The vector's layout is agreed once, at construction (collective).
    """

    def __init__(self, parts: Mapping[int, nn.Module], group: Any, device: torch.device) -> None:
        """`parts`: this rank's stage modules keyed by their weight group (model part) index."""
        self.group = group
        self.device = device
        mine = {k: [(layer.num_experts, layer.bias_update_speed) for layer in moe_layers(m)]
                for k, m in parts.items()}
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        shapes: dict[int, list[tuple[int, float]]] = {}
        for table in gathered:
            shapes.update(table)
        self.offsets: dict[tuple[int, int], int] = {}
        size = 0
        for k in sorted(shapes):
            for j, (experts, _) in enumerate(shapes[k]):
                self.offsets[(k, j)] = size
                size += experts
        self.size = size
        self.layers = sum(len(v) for v in shapes.values())
        """MoE layers in the whole model."""
        self.active = any(speed for layers in shapes.values() for _, speed in layers)
        """Some layer of the model updates its expert bias (the same verdict on every rank)."""

    def gather(self, copies: Sequence[tuple[int, nn.Module]], wait: Wait = plain_wait) -> Tensor:
        """Every layer's load summed over the job (collective). `copies`: (part, module) of every stage this
        rank holds, both DualPipe copies included."""
        flat = torch.zeros(self.size, dtype=torch.float64, device=self.device)
        for k, module in copies:
            for j, layer in enumerate(moe_layers(module)):
                at = self.offsets[(k, j)]
                flat[at:at + layer.num_experts] += layer.load.to(flat)
        wait(dist.all_reduce(flat, group=self.group, async_op=True), "the MoE expert-load all-reduce")
        return flat

    def update(self, copies: Sequence[tuple[int, nn.Module]], wait: Wait = plain_wait) -> None:
        """Update every layer's expert bias from the job's summed load, then reset the counts (collective)."""
        total = self.gather(copies, wait) if self.active else None
        for k, module in copies:
            for j, layer in enumerate(moe_layers(module)):
                if total is not None:
                    at = self.offsets[(k, j)]
                    layer.update_bias(total[at:at + layer.num_experts])
                layer.reset_load()
