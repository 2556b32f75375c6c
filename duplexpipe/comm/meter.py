"""Bytes on the wire: a ring-model meter that reducers feed, and a c10d dispatch counter to cross-check it.

Ring model, bytes one rank sends for a collective over n ranks on a tensor of B bytes:
- all_reduce: 2 (n-1)/n x B (reduce-scatter then all-gather around a ring);
- reduce_scatter: (n-1)/n x B, B the whole input;
- all_gather: (n-1)/n x B, B the whole output (n chunks; a rank sends its chunk n-1 times);
- all_to_all: (n-1)/n x B, B this rank's input (every chunk but its own leaves it);
- broadcast: (n-1)/n x B (a pipelined chain: every rank but the last forwards B; averaged over ranks);
- send: B; recv: 0 (counted at the sender).
With n = 1 every collective costs 0 bytes.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}
KINDS = tuple(_FACTOR)
"""The collective kinds the ring model knows."""


def ring_bytes(kind: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends for collective `kind` on `nbytes` over `group_size` ranks (see the module doc)."""
    if kind not in _FACTOR:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
    if group_size < 1 or nbytes < 0:
        raise ValueError(f"need group_size >= 1 and nbytes >= 0, got {group_size} and {nbytes}")
    return _FACTOR[kind](group_size) * nbytes


class WireMeter:
    """Running totals of collectives and their ring-model bytes per rank, by kind."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: defaultdict[str, float] = defaultdict(float)

    def record(self, kind: str, nbytes: int, group_size: int) -> None:
        """Count one collective of `kind` on `nbytes` (the model's B) over `group_size` ranks."""
        self.bytes[kind] += ring_bytes(kind, nbytes, group_size)
        self.calls[kind] += 1

    @property
    def total_bytes(self) -> float:
        """Ring-model bytes this rank sent, all kinds together."""
        return float(sum(self.bytes.values()))

    def reset(self) -> None:
        """Start counting from zero."""
        self.calls.clear()
        self.bytes.clear()

    def snapshot(self) -> dict[str, Any]:
        """A plain-data copy: {"total_bytes", "bytes": {kind: ...}, "calls": {kind: ...}}."""
        return {"total_bytes": self.total_bytes, "bytes": dict(self.bytes), "calls": dict(self.calls)}


_C10D_OPS = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_": ("all_gather", "output_tensors"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "alltoall_base_": ("all_to_all", "input"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "broadcast_": ("broadcast", "tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class C10dCounter(TorchDispatchMode):
    """A dispatch mode that feeds `meter` from the c10d ops it sees, to cross-check a reducer's own counts.

    It sees the ops issued on the thread that entered it: torch's hooks that chain collectives in future
    callbacks (PowerSGD) may issue those on a gloo thread it never sees. Ops outside the ring model
    (barriers, ...) are listed in `unmodelled`.
    """

    def __init__(self, meter: WireMeter) -> None:
        super().__init__()
        self.meter = meter
        self.unmodelled: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        named = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)} | kwargs
        entry = _C10D_OPS.get(func._schema.name.split("::")[-1])
        group = named.get("process_group")
        if entry is None or group is None:
            self.unmodelled.append(str(func))
            return
        kind, arg = entry
        if not isinstance(group, dist.ProcessGroup):  # the dispatcher hands over a boxed ScriptObject
            group = dist.ProcessGroup.unbox(group)
        self.meter.record(kind, _nbytes(named[arg]), int(group.size()))
