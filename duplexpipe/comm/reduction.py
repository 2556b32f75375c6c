"""The reducer interface: start a bucket's asynchronous reduction, get a handle, finish it with a given wait."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from duplexpipe.comm.bucket import Bucket
from duplexpipe.comm.link import EmulatedLink
from duplexpipe.comm.meter import WireMeter


class Waitable(Protocol):
    """What a reduction waits on: a c10d Work, or a FutureWork around a torch Future."""

    def is_completed(self) -> bool:
        """True once the operation finished (never blocks)."""

    def wait(self) -> Any:
        """Block until it finished; raise its error if it failed."""


WaitFn = Callable[[Waitable, str], None]
"""wait(work, what): return once `work` completed (the trainer's is bounded and failure-aware)."""


def blocking_wait(work: Waitable, what: str) -> None:
    """An unbounded wait: work.wait() (for tests and scripts; the trainer passes its watchdog's)."""
    work.wait()


class FutureWork:
    """A torch Future seen as a Waitable."""

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        self.future = future

    def is_completed(self) -> bool:
        """The future's done()."""
        return bool(self.future.done())

    def wait(self) -> Any:
        """The future's wait(): its value, or its error raised."""
        return self.future.wait()


Phases = Generator[tuple[Waitable, str], None, None]
"""A reduction's body: it yields (work, what) for every collective it must wait for before going on."""


class Reduction:
    """One bucket's reduction in flight, its first collective already posted; finish() completes it and
    leaves the mean in the bucket's buffer."""

    def __init__(self, bucket: Bucket, phases: Phases, link: EmulatedLink | None = None,
                 meter: WireMeter | None = None) -> None:
        self.bucket = bucket
        self.link = link
        """An emulated link each phase's collectives are held for (the bytes `meter` counted in the phase)."""
        self.meter = meter
        self.compute_s = 0.0
        """Seconds this thread spent in the reduction's own compute (compress, decompress), waits excluded."""
        self._buffer = bucket.buffer()
        self._phases = phases
        self._current: tuple[Waitable, str] | None = None
        self._advance()

    @property
    def done(self) -> bool:
        """True once the mean is in the bucket's buffer."""
        return self._current is None

    @property
    def pending(self) -> Waitable | None:
        """The collective the reduction waits for next (None once done): e.g. to time its completion."""
        return None if self._current is None else self._current[0]

    @property
    def what(self) -> str:
        """What the pending collective is, in words ("" once done)."""
        return "" if self._current is None else self._current[1]

    def finish(self, wait: WaitFn = blocking_wait) -> Tensor:
        """Wait (with `wait`) for each remaining collective and run the phases after it (which may post
        the next collective); return the bucket's buffer holding the mean over the group."""
        while self._current is not None:
            work, what = self._current
            wait(work, what)
            self.advance()
        return self._buffer

    def advance(self) -> None:
        """Once the pending collective completed: surface its error, if it failed, and run the phases up to the
        next collective (or the end)."""
        if self._current is None:
            raise RuntimeError(f"the reduction of bucket {self.bucket.index()} is already done")
        self._current[0].wait()  # returns at once: it completed
        self._advance()

    def _advance(self) -> None:
        begin = time.perf_counter()
        sent = self.meter.total_bytes if self.meter is not None else 0.0
        try:
            self._current = next(self._phases, None)
        finally:
            self.compute_s += time.perf_counter() - begin
        sent = (self.meter.total_bytes - sent) if self.meter is not None else 0.0
        if self.link is not None and self._current is not None and sent > 0:  # a wait that moves no bytes: as is
            work, what = self._current
            self._current = self.link.hold(work, sent), what


class Reducer(ABC):
    """Averages flat buckets of gradients over a data-parallel group, one asynchronous reduction per bucket.

    Per step: start(bucket) for each bucket (each index once), finish() every handle, then
    end_step(applied): True commits the step's residuals and compressor state, False (a skipped step)
    restores them as they were. Replicas end with bit-identical buffers.

    Collective order: reducers post collectives only inside start() and finish(), on the calling thread, so
    every rank posts them in its program order (call start/finish at the same program points on every
    rank; random draws such as stochastic rounding's also follow that order). PowerSGD is the exception
    (torch's hook chains its all-reduces in future callbacks): its group must be used by nothing else while
    reductions are in flight (see PowerSGDReducer).
    """

    method = "abstract"

    def __init__(self, group: Any = None, meter: WireMeter | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.meter = meter if meter is not None else WireMeter()
        self.link: EmulatedLink | None = None
        """An emulated link (benchmarks, tests): every collective is held for the bytes it puts on the wire."""
        self._started: dict[int, Reduction] = {}

    def start(self, bucket: Bucket) -> Reduction:
        """Start reducing `bucket` (its buffer holds this rank's gradients; leave it alone until finished)."""
        buf, index = bucket.buffer(), bucket.index()
        if buf.dim() != 1 or not buf.is_contiguous() or not buf.dtype.is_floating_point or buf.numel() == 0:
            raise ValueError(f"bucket {index}: expected a non-empty flat contiguous floating buffer, got shape "
                             f"{tuple(buf.shape)} dtype {buf.dtype}")
        if index in self._started:
            raise RuntimeError(f"{self.method}: bucket {index} was already started in this step "
                               "(call end_step() after each step)")
        reduction = Reduction(bucket, self._phases(bucket), self.link, self.meter)
        self._started[index] = reduction
        return reduction

    def end_step(self, applied: bool) -> None:
        """Close the step: commit (applied=True) or roll back (False) every bucket's state change."""
        open_ = sorted(i for i, r in self._started.items() if not r.done)
        if open_:
            raise RuntimeError(f"{self.method}: finish the reductions of buckets {open_} before end_step()")
        self._started.clear()
        self._close(applied)

    def set_link(self, link: EmulatedLink | None) -> None:
        """Hold every collective for an emulated link from now on (None: real time only)."""
        if link is not None and not isinstance(link, EmulatedLink):
            raise ValueError(f"set_link needs an EmulatedLink or None, got {link!r}")
        self.link = link

    def take_residual(self, index: int) -> Tensor | None:
        """Remove bucket `index`'s committed error feedback and return it in a form any reducer can take over: a
        flat tensor of the bucket's layout, in gradient units, that added to this rank's next gradient of the
        bucket transmits what was held back (None: the method keeps none). Between steps only."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Residuals and compressor state (tensors and plain data), keyed by bucket index where per bucket."""
        return {"method": self.method}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned (from a reducer of the same method)."""
        if state.get("method") != self.method:
            raise ValueError(f"state is for method {state.get('method')!r}, this reducer is {self.method!r}")

    @abstractmethod
    def _phases(self, bucket: Bucket) -> Phases:
        """The reduction's body (see Phases); it writes the mean into bucket.buffer() at its end."""

    def _close(self, applied: bool) -> None:
        """Commit or roll back this step's state (nothing for stateless reducers)."""
        return None

    def _all_reduce(self, tensor: Tensor) -> Any:
        self.meter.record("all_reduce", tensor.numel() * tensor.element_size(), self.size)
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def _all_gather(self, output: Tensor, tensor: Tensor) -> Any:
        self.meter.record("all_gather", output.numel() * output.element_size(), self.size)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output, tensor, group=self.group, async_op=True)

    def _all_to_all(self, output: Tensor, tensor: Tensor) -> Any:
        self.meter.record("all_to_all", tensor.numel() * tensor.element_size(), self.size)
        return dist.all_to_all_single(output, tensor, group=self.group, async_op=True)


class ExactReducer(Reducer):
    """No compression: one all-reduce (sum) of the buffer, then division by the group size."""

    method = "none"

    def _phases(self, bucket: Bucket) -> Phases:
        buf = bucket.buffer()
        yield self._all_reduce(buf), f"the all-reduce of gradient bucket {bucket.index()}"
        buf.div_(self.size)
