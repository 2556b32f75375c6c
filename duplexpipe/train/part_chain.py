"""Given model parts merged into a schedule's fewer model parts: `PartChain` and the matching init."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from duplexpipe.model.stages import CHAINED_PARTS, PartInit
from duplexpipe.runtime.structure import WHOLE_MESSAGE, call, flatten


class PartChain(nn.Module):
    """Model parts run one after another, each called on the previous one's output as the runtime
    calls a stage (a tuple/list as positional arguments, a dict as keyword arguments)."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        setattr(self, CHAINED_PARTS, True)
        setattr(self, WHOLE_MESSAGE, getattr(parts[0], WHOLE_MESSAGE, False))  # called as its first part is

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.parts[0](*args, **kwargs)
        for part in list(self.parts)[1:]:
            form, leaves = flatten(out, "output")
            out = call(part, form, leaves)
        return out


def merge_parts(parts: Sequence[nn.Module], counts: Sequence[int]) -> list[nn.Module]:
    """`parts` as len(counts) model parts of `counts` parts each, in order: a run of several becomes one PartChain."""
    out: list[nn.Module] = []
    start = 0
    for count in counts:
        run = list(parts[start:start + count])
        out.append(run[0] if count == 1 else PartChain(run))
        start += count
    return out


def merge_init(init: PartInit | None, counts: Sequence[int]) -> PartInit | None:
    """`init(part, k)` for `merge_parts`' parts: each given part k inside a chain is filled by init(part, k)."""
    if init is None:
        return None
    firsts = [sum(counts[:g]) for g in range(len(counts))]

    def fill(module: nn.Module, group: int) -> None:
        inner = module.parts if isinstance(module, PartChain) else [module]
        for offset, part in enumerate(inner):
            init(part, firsts[group] + offset)
    return fill
