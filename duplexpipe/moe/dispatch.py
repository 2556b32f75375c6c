"""Token dispatch and combine for expert parallelism: permute by expert, all-to-all with uneven splits, regroup.

Every all-to-all goes through the comm slot of the forward that made it (`runtime.comm_points`), in the forward
and in its backward, so inside an F&B pair it runs while the other microbatch computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from duplexpipe.runtime.comm_points import CommSlot


@dataclass(frozen=True)
class ExpertGroup:
    """The expert-parallel group a layer's experts are spread over."""

    group: Any
    """The process group (None: the default group)."""
    rank: int
    """This rank's index in it: it holds experts rank * local .. (rank + 1) * local - 1."""
    size: int
    """Ranks in the group."""


def exchange(x: Tensor, send: list[int], recv: list[int], ep: ExpertGroup, slot: CommSlot, label: str) -> Tensor:
    """all_to_all of the rows of `x`: `send[r]` rows to rank r, `recv[r]` rows from it (no autograd); a comm
    point of an F&B pair."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    x = x.contiguous()
    slot.driver.exchange(lambda: dist.all_to_all_single(out, x, recv, send, group=ep.group, async_op=True),
                         label, x.numel() * x.element_size())
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], ep: ExpertGroup, slot: CommSlot,
                label: str) -> Tensor:
        ctx.meta = (send, recv, ep, slot, label)
        return exchange(x, send, recv, ep, slot, label)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        send, recv, ep, slot, label = ctx.meta
        return exchange(grad, recv, send, ep, slot, f"{label} backward"), None, None, None, None, None


def all_to_all(x: Tensor, send: list[int], recv: list[int], ep: ExpertGroup, slot: CommSlot, label: str) -> Tensor:
    """Differentiable all_to_all of rows over the expert-parallel group."""
    out: Tensor = _AllToAll.apply(x, send, recv, ep, slot, label)
    return out


class CountsExchange:
    """The token counts' exchange, posted as soon as the counts exist and waited for in place (`received`),
    not a comm point of an F&B pair: a few bytes, needed to size the dispatch. Work done between posting and
    waiting (the shared experts) hides the wait for the slowest rank of the group."""

    def __init__(self, counts: Tensor, ep: ExpertGroup, slot: CommSlot, label: str) -> None:
        local = counts.numel() // ep.size
        sent = counts.view(ep.size, local).contiguous()
        self._got = torch.empty_like(sent)
        self._posted = slot.driver.post(lambda: dist.all_to_all_single(self._got, sent, group=ep.group,
                                                                       async_op=True),
                                        label, sent.numel() * sent.element_size())

    def received(self) -> list[list[int]]:
        """recv[s][e]: tokens rank s sends to this rank's local expert e (waits for the exchange)."""
        self._posted.wait()
        return [[int(v) for v in row] for row in self._got.cpu().tolist()]


def expert_major(recv: list[list[int]]) -> Tensor | None:
    """The permutation that reorders rows received grouped by (source, local expert) into (local expert,
    source) order; None when it is the identity (one source)."""
    if len(recv) == 1:
        return None
    sources, local = len(recv), len(recv[0])
    starts, at = [[0] * local for _ in range(sources)], 0
    for s in range(sources):
        for e in range(local):
            starts[s][e] = at
            at += recv[s][e]
    pieces = [torch.arange(starts[s][e], starts[s][e] + recv[s][e]) for e in range(local) for s in range(sources)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
