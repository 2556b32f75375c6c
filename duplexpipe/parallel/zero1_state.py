"""ZeRO-1 optimizer state in checkpoints: per-parameter entries, each rank storing only its pieces.

The entries have the keys and shapes of torch's flattened optimizer state dict
(`state.<param>.<name>`, `param_groups.<param>.<hyperparameter>`), as zero_stage=0 writes them. A
per-element state tensor is a ShardedTensor whose local shards are boxes of the parameter's shape cut from
this rank's flat shard (views: loading writes straight into the optimizer state). torch.distributed.checkpoint
stores the boxes and reads any other layout back, so a checkpoint reloads at another data-parallel size or
ZeRO stage (resharding on load).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from duplexpipe.parallel.flat import FlatLayout, Piece, boxes
from duplexpipe.parallel.sharded_optimizer import FlatGroup, ShardedOptimizer


def _per_element(value: Any, flat: FlatGroup) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == flat.master.numel()


def _piece(layout: FlatLayout, rank: int, index: int) -> Piece | None:
    return next((p for p in layout.pieces(rank) if p.index == index), None)


def _sharded(value: Tensor, flat: FlatGroup, index: int, group: Any, global_ranks: list[int]) -> ShardedTensor:
    """The state tensor of parameter `index` as a ShardedTensor of its shape (this rank's boxes are views)."""
    shape = tuple(flat.params[index].shape)
    device = value.device
    metas: list[ShardMetadata] = []
    local: list[Shard] = []
    for rank, global_rank in enumerate(global_ranks):
        piece = _piece(flat.layout, rank, index)
        if piece is None:
            continue
        for box in boxes(shape, piece.start, piece.stop):
            meta = ShardMetadata(list(box.offsets), list(box.sizes), f"rank:{global_rank}/{device}")
            metas.append(meta)
            if rank == flat.rank:
                lo = piece.offset + box.start - piece.start
                local.append(Shard(value[lo:lo + box.numel].view(box.sizes), meta))
    props = TensorProperties(dtype=value.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta_all = ShardedTensorMetadata(metas, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta_all, process_group=group)


def init_state(opt: ShardedOptimizer) -> bool:
    """Create the optimizer state (a step with zero gradients and learning rate 0) if it has none yet;
    True if it did (the caller may clear it again to keep a fresh optimizer fresh)."""
    inner = opt.optimizer
    if inner.state:
        return False
    lrs = [g["lr"] for g in inner.param_groups]
    for g in inner.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], Tensor) else 0.0
    for flat in opt.flats:
        flat.master.grad = torch.zeros_like(flat.master)
    try:
        inner.step()
    finally:
        for g, lr in zip(inner.param_groups, lrs, strict=True):
            g["lr"] = lr
        opt.zero_grad()
    return True


def state_dict(opt: ShardedOptimizer, group: Any, global_ranks: list[int]) -> dict[str, Any]:
    """The flattened per-parameter optimizer state (create it first with init_state).

    `group` is the data-parallel process group (None when alone), `global_ranks` its members' global ranks.
    A parameter with no piece on this rank contributes only its replicated entries here.
    """
    out: dict[str, Any] = {}
    inner = opt.optimizer
    for flat in opt.flats:
        state = inner.state.get(flat.master, {})
        hyper = {k: v for k, v in inner.param_groups[flat.group].items() if k != "params"}
        for index, name in enumerate(flat.names):
            for key, value in state.items():
                if not _per_element(value, flat):
                    out[f"state.{name}.{key}"] = value
                elif _piece(flat.layout, flat.rank, index) is not None:
                    out[f"state.{name}.{key}"] = _sharded(value, flat, index, group, global_ranks)
            for key, value in hyper.items():
                out[f"param_groups.{name}.{key}"] = value
    return out


def model_state_dict(opt: ShardedOptimizer, model: dict[str, Any], group: Any,
                     global_ranks: list[int]) -> dict[str, Any]:
    """`model` (the stage modules' state dict) with the flattened parameters replaced by their full-precision
    master shards when the masters are copies of their own (qwZ: the parameters hold dequantized values)."""
    if not opt.own_master:
        return model
    out = dict(model)
    for flat in opt.flats:
        for index, name in enumerate(flat.names):
            if _piece(flat.layout, flat.rank, index) is None:
                out.pop(name, None)
            else:
                out[name] = _sharded(flat.master, flat, index, group, global_ranks)
    return out


def plain_entries(model: dict[str, Any]) -> dict[str, Any]:
    """The entries of a model state dict that are not ShardedTensors (those were read into the masters)."""
    return {k: v for k, v in model.items() if not isinstance(v, ShardedTensor)}


def load_state_dict(opt: ShardedOptimizer, loaded: dict[str, Any]) -> None:
    """Take over what torch.distributed.checkpoint loaded into a dict made by `state_dict`: the per-element
    entries were written in place; replicated entries (e.g. `step`) and hyperparameters are copied here."""
    inner = opt.optimizer
    for flat in opt.flats:
        state = inner.state.get(flat.master, {})
        first = flat.names[0]
        for key, value in list(state.items()):
            if _per_element(value, flat):
                continue
            got = loaded[f"state.{first}.{key}"]
            if isinstance(value, Tensor):
                value.copy_(got)
            else:
                state[key] = got
        group = inner.param_groups[flat.group]
        for key in list(group):
            if key != "params" and f"param_groups.{first}.{key}" in loaded:
                group[key] = loaded[f"param_groups.{first}.{key}"]


def dp_global_ranks(group: Any) -> list[int]:
    """The global ranks of a data-parallel group's members in group order (this rank alone when None)."""
    if group is None:
        return [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
