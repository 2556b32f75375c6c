"""Agreement at construction over one process group with tensor collectives: which flags some rank raised, and the
short texts every rank holds (so that every rank raises the same error)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def _group_size(group: Any) -> int:
    """Ranks of `group` (None: the default group); 1 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def any_rank(flags: Sequence[bool], group: Any, device: torch.device) -> list[bool]:
    """Per flag, whether it holds on any rank of `group` (one all-reduce of len(flags) integers; every rank passes
    as many flags, in one order)."""
    if _group_size(group) == 1:
        return list(flags)
    raised = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(raised, op=dist.ReduceOp.MAX, group=group)
    return [bool(x) for x in raised.tolist()]


def every_rank_texts(texts: Sequence[str], group: Any, device: torch.device) -> list[list[str]]:
    """`texts` of every rank of `group`, in group rank order: one all-reduce of their encoded length and one
    all-gather of fixed-size byte tensors (no pickled objects)."""
    if _group_size(group) == 1:
        return [list(texts)]
    blob = json.dumps(list(texts)).encode()
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    mine = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    mine[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(_group_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [json.loads(bytes(t.cpu().tolist()).rstrip(b"\0").decode()) for t in gathered]
