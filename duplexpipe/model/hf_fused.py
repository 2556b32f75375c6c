"""MoE checkpoints whose experts are stored fused, as transformers holds them in memory (`mlp.experts.gate_up_proj`
[E, 2I, D], `mlp.experts.down_proj` [E, D, I]): each expert's published tensor is found as a slice of a fused one
and read alone with the safetensors library (a rank reads only the slices of its own experts)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

_EXPERT = re.compile(r"^(?P<layer>.+)\.(?P<block>mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                     r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_UPPER = {"gate_proj": False, "w1": False, "up_proj": True, "w3": True}
"""Which half of gate_up_proj a projection is (transformers concatenates gate, then up)."""


class Stored(Protocol):
    """What the file layer says about one stored tensor."""

    @property
    def file(self) -> Path: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class FusedSlice:
    """One expert's projection inside a fused tensor: rows `start:stop` of entry `expert` of tensor `name`."""

    file: Path
    """The safetensors file holding the fused tensor."""
    name: str
    """The fused tensor's name."""
    expert: int
    """Its index along the first dimension."""
    start: int
    """First row of the projection in that entry."""
    stop: int
    """Row just past it."""
    shape: tuple[int, ...]
    """The projection's shape (what the published tensor has)."""

    def mismatch(self, shape: tuple[int, ...]) -> str:
        """Why it cannot fill a target of `shape`."""
        return (f"{self.file}: {self.name}[{self.expert}, {self.start}:{self.stop}] has shape {self.shape}, the model "
                f"needs {shape}")

    def read(self, handle: Any) -> Tensor:
        """The projection, from `handle` (safetensors' `safe_open` of its file)."""
        return handle.get_slice(self.name)[self.expert, self.start:self.stop]


def fused_source(name: str, files: Mapping[str, Stored]) -> FusedSlice | None:
    """Where a published expert tensor (`model.layers.3.mlp.experts.5.up_proj.weight`; Mixtral
    `block_sparse_moe.experts.5.w3.weight`) sits in a checkpoint that holds the experts fused (None: it does not)."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    base = f"{match['layer']}.mlp.experts"
    proj, expert = match["proj"], int(match["e"])
    fused = f"{base}.down_proj" if proj in ("down_proj", "w2") else f"{base}.gate_up_proj"
    stored = files.get(fused)
    if stored is None or len(stored.shape) != 3 or expert >= stored.shape[0]:
        return None
    rows = stored.shape[1]
    if fused.endswith("down_proj"):
        return FusedSlice(stored.file, fused, expert, 0, rows, tuple(stored.shape[1:]))
    half = rows // 2
    start = half if _UPPER[proj] else 0
    return FusedSlice(stored.file, fused, expert, start, start + half, (half, stored.shape[2]))


def renamed_source(name: str, files: Mapping[str, Stored]) -> str | None:
    """The name a published tensor has in a checkpoint that holds it under transformers' in-memory names
    (Mixtral: `block_sparse_moe.` -> `mlp.`); None when the files have no such tensor."""
    other = name.replace(".block_sparse_moe.", ".mlp.")
    return other if other != name and other in files else None


