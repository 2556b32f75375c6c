"""The timeline's "tp" lane: DTensor's collectives (torch's functional collectives) timed from issue to wait."""

from __future__ import annotations

import time
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from duplexpipe.schedules.timeline import Span

TP_LANE = "tp"
"""The timeline lane of the tensor-parallel collectives."""
FUNCTIONAL = "_c10d_functional"
"""The namespace of torch's functional collectives, which DTensor issues (and nothing else duplexpipe runs does)."""


class TPCollectives(TorchDispatchMode):
    """A dispatch mode that times every functional collective it sees: from the op's issue to the end of the
    `wait_tensor` that waits for it. DTensor issues its collectives (a redistribution in a ParallelStyle's hooks,
    in the backward of one) through these ops; the pipeline's own transfers, the data-parallel reductions and the
    expert-parallel all-to-alls use c10d's other ops and are not seen. It sees the ops of the thread that entered
    it (and of the autograd engine running that thread's backward); collectives issued inside an F&B pair's worker
    threads or inside DTensor's own operator dispatch are not timed."""

    def __init__(self) -> None:
        super().__init__()
        self._issued: dict[int, tuple[str, float]] = {}
        self.records: list[tuple[str, float, float]] = []
        """(collective, issued, done) in perf_counter seconds."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace != FUNCTIONAL:
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        begin = time.perf_counter()
        out = func(*args, **kwargs)
        if name == "wait_tensor":
            issued = self._issued.pop(id(args[0]), None) if args else None
            if issued is not None:
                self.records.append((issued[0], issued[1], time.perf_counter()))
        else:
            self._issued[id(out)] = (name, begin)
        return out

    def spans(self, origin: float, rank: int) -> list[Span]:
        """The timed collectives as spans on the "tp" lane, relative to `origin` (a step's perf_counter start)."""
        return [Span(rank, TP_LANE, name, start - origin, end - origin) for name, start, end in self.records]
