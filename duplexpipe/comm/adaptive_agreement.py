"""How the ranks of a group make the same adaptive-compression moves: each step's measurements and rungs go into one
all-reduce (max), posted at the step's end and completed a step later, and every rank's controller decides from
the same agreed values."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from duplexpipe.comm.adaptive import CompressionReport, Controller, Decision
from duplexpipe.comm.reduction import WaitFn
from duplexpipe.errors import PipelineError

LAG = 1
"""Steps between a step and the settle that decides from its measurements, less one: a move made at the end of step
t applies from step t+1, whose measurements are decided on at the end of step t+2, so the one decided on at the end
of step t+1 (step t's) still predates it (`Controller.lag`)."""


class Agreement:
    """Drives `controller` from measurements agreed over `group` (every rank of it holds the same keys).

    `post` ends a step: its seconds, each key's exposed seconds and this rank's rungs go into one all-reduce (max)
    over the group, posted without waiting. `settle`, at the end of the next step (before its own `post`),
    completes it: that step's collectives on the group came after it, so it is complete and nobody waits. Every
    rank then feeds the same values to its controller, so all make the same moves at the same step (applied from
    the step after); a rank whose rungs differ from another's is caught there.

    The agreed step is the slowest rank's; a key's agreed exposure is the smallest over the ranks that measure it
    (sent negated, so one max gives it): a reduction completes at about the same time on every replica, so the
    replica whose compute ended last waited only for the transfer, while the others also waited for it (skew
    that no compression removes). A stage link is measured by its receiver alone.

    On the step's critical path it costs one non-blocking all-reduce posted straight on the process group (not
    through torch.distributed's Python wrappers) and, when that has completed (as it normally has), no bounded
    wait: a few hundred microseconds of a core less."""

    def __init__(self, controller: Controller, group: Any, what: str,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.controller = controller
        self.group = group
        self.what = what
        """Whose agreement it is, for errors ("the data-parallel group", "the pipeline's stage links")."""
        self.clock = clock
        self._pg: Any = group if group is not None else dist.group.WORLD
        self._max = dist.AllreduceOptions()
        self._max.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self.last: CompressionReport | None = None
        """The report of the last step posted."""
        self._pending: tuple[Any, Tensor, float | None] | None = None
        self._moves: list[Decision] = []
        self._spent = (0.0, 0.0)

    def post(self, exposed_s: Mapping[str, float], step_s: float, loss: float | None, device: torch.device,
             used: Mapping[str, str] | None = None) -> CompressionReport:
        """End a step (after `settle`): post the all-reduce of its measurements and the rungs from now on; this
        step's report (the rungs it `used`, default the current ones; this rank's measurements; the moves made
        at its end; the controller's seconds)."""
        begin = (self.clock(), time.thread_time())
        keys, ctl = self.controller.keys, self.controller
        rungs = [float(r) for r in ctl.rungs()]
        unmeasured = -math.inf  # a key this rank does not measure (another rank's incoming stage link)
        vec = torch.tensor([step_s, *(-exposed_s[k] if k in exposed_s else unmeasured for k in keys), *rungs,
                            *(-r for r in rungs)], dtype=torch.float64, device=device)
        self._pending = (self._pg.allreduce([vec], self._max), vec, loss)
        spent, self._spent = self._add(begin), (0.0, 0.0)
        local = {k: float(exposed_s.get(k, 0.0)) for k in keys}
        self.last = CompressionReport(dict(used) if used is not None else ctl.choices(), local, tuple(self._moves),
                                      *spent)
        self._moves = []
        return self.last

    def settle(self, wait: WaitFn) -> list[Decision]:
        """Complete the agreement posted last, check the rungs, decide; the moves (none when nothing was posted)."""
        if self._pending is None:
            return []
        begin = (self.clock(), time.thread_time())
        work, vec, loss = self._pending
        self._pending = None
        if work.is_completed():  # posted a step ago, on a group whose later collectives completed since
            work.wait()
        else:
            wait(work, f"the adaptive compression's agreement all-reduce over {self.what}")
        values = vec.tolist()
        keys = list(self.controller.keys)
        n = len(keys)
        high, low = values[1 + n:1 + 2 * n], [-v for v in values[1 + 2 * n:]]
        differ = [k for k, h, lo in zip(keys, high, low, strict=True) if h != lo]
        if differ:
            raise PipelineError(f"adaptive compression: the ranks of {self.what} used different rungs for {differ} "
                                f"(highest {high}, lowest {low}); their controllers diverged")
        agreed = {k: max(0.0, -v) if math.isfinite(v) else 0.0 for k, v in zip(keys, values[1:1 + n], strict=True)}
        moves = self.controller.observe(values[0], agreed, loss)
        self._moves += moves
        self._spent = self._add(begin)
        return moves

    def forget(self) -> None:
        """Drop the agreement in flight without completing it (a restored controller decides from the next step's
        measurements on)."""
        self._pending, self._moves, self._spent = None, [], (0.0, 0.0)

    def _add(self, begin: tuple[float, float]) -> tuple[float, float]:
        """The controller's (wall, CPU) seconds so far in this step, with those since `begin`."""
        return (self._spent[0] + self.clock() - begin[0], self._spent[1] + time.thread_time() - begin[1])
