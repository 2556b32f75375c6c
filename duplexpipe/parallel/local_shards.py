"""ZeRO-2's optimizer on plain tensors: aliases of the local shards of FSDP's DTensor parameters.

An optimizer over DTensor parameters pays DTensor's Python dispatch on every elementwise op of its update
(single-tensor AdamW: about a dozen ops per parameter), which on CPU costs more than the update itself. The
local shard of each parameter (and of its gradient) is an ordinary tensor that shares the DTensor's storage,
so the optimizer steps those: the same arithmetic on the same elements, without the dispatch. Checkpoints keep
torch's per-parameter DTensor form: `as_dtensors` shows the optimizer with the module's parameters and
DTensor-wrapped state while torch.distributed.checkpoint reads or fills it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from duplexpipe.comm.local_tensors import local_of


class LocalShards:
    """One plain nn.Parameter per DTensor parameter, aliasing its local shard; the optimizer's parameters."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        """The module's (DTensor) parameters."""
        self.shards = [nn.Parameter(local_of(p), requires_grad=p.requires_grad) for p in params]
        """Their local shards as parameters (same storage)."""

    def take_grads(self) -> None:
        """Point each shard's .grad at its parameter's local gradient shard (and each shard at its parameter's
        current storage, should FSDP have re-padded it)."""
        for shard, p in zip(self.shards, self.params, strict=True):
            local = local_of(p)
            if shard.data_ptr() != local.data_ptr() or shard.shape != local.shape:
                shard.data = local
            shard.grad = None if p.grad is None else local_of(p.grad)

    def clear_grads(self) -> None:
        """Drop the gradients of both the parameters and the shards."""
        for shard, p in zip(self.shards, self.params, strict=True):
            p.grad = None
            shard.grad = None

    @contextmanager
    def as_dtensors(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Within: `optimizer` holds the DTensor parameters and DTensor state (views of the local state), as an
        optimizer built over the module would; after: the shards and their local state again, including
        whatever was loaded in between."""
        of_shard = {id(s): p for s, p in zip(self.shards, self.params, strict=True)}
        of_param = {id(p): s for s, p in zip(self.shards, self.params, strict=True)}
        for group in optimizer.param_groups:
            group["params"] = [of_shard[id(s)] for s in group["params"]]
        optimizer.state = _rekeyed(optimizer.state, of_shard, _to_dtensor)
        try:
            yield
        finally:
            optimizer.state = _rekeyed(optimizer.state, of_param, lambda v, _: local_of(v))
            for group in optimizer.param_groups:
                group["params"] = [of_param[id(p)] for p in group["params"]]


def _to_dtensor(value: Any, param: Tensor) -> Any:
    """A state tensor shaped like `param`'s local shard as a DTensor laid out like `param` (same storage)."""
    if not isinstance(value, Tensor) or not isinstance(param, DTensor) or value.shape != param._local_tensor.shape:
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _rekeyed(state: Any, to: dict[int, Any], convert: Any) -> defaultdict[Any, Any]:
    """The optimizer state keyed by `to[id(key)]`, each value passed through convert(value, new key)."""
    out: defaultdict[Any, Any] = defaultdict(dict)
    for key, entries in state.items():
        new = to[id(key)]
        out[new] = {name: convert(value, new) for name, value in entries.items()}
    return out
