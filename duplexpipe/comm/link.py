"""An emulated link for benchmarks and tests: its model (latency, bandwidth), and a link whose transfers queue one
after another and whose model may change during a run, holding collectives until their emulated completion."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LinkModel:
    """An emulated link: a collective completes no earlier than `latency_s + bytes / bandwidth_bytes_per_s`
    after it could start, i.e. after every rank of its group joined it (taken as when its real transfer
    completed: a rank's tokens cannot leave before that rank issued the collective); the waiting sleeps, so a
    core is free meanwhile."""

    latency_s: float = 0.0
    """Seconds added to every transfer."""
    bandwidth_bytes_per_s: float = float("inf")
    """Bytes per second of the link (inf: no bandwidth term)."""

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            raise ValueError(f"LinkModel.latency_s must be >= 0, got {self.latency_s}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"LinkModel.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")

    def seconds(self, nbytes: float) -> float:
        """The emulated transfer time of `nbytes`."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def hold(self, start: float, nbytes: int) -> None:
        """Sleep until `start` (perf_counter) + the transfer time of `nbytes`."""
        left = start + self.seconds(nbytes) - time.perf_counter()
        if left > 0:
            time.sleep(left)


class EmulatedLink:
    """One rank's emulated link, shared by the transfers it carries: each occupies it for its LinkModel time,
    starting when it is posted or when the one before it finished, whichever is later (a FIFO). `model` may be
    replaced at any time (a link that changes during a run); transfers posted after that take the new time.
    Every rank of a group should emulate the same link."""

    def __init__(self, model: LinkModel, clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(model, LinkModel):
            raise ValueError(f"EmulatedLink needs a LinkModel, got {model!r}")
        self.model = model
        """The link's latency and bandwidth now."""
        self.clock = clock
        self.free_at = 0.0
        """When the last transfer posted finishes (clock seconds)."""

    def deadline(self, nbytes: float) -> float:
        """Queue a transfer of `nbytes` posted now; the clock time it completes."""
        begin = max(self.clock(), self.free_at)
        self.free_at = begin + self.model.seconds(nbytes)
        return self.free_at

    def hold(self, work: Any, nbytes: float) -> HeldWork:
        """`work` (a c10d Work or a Waitable) held until the emulated completion of `nbytes` posted now."""
        return HeldWork(work, self.deadline(nbytes), self.clock)


class HeldWork:
    """A Waitable that completes once `work` completed and the clock reached `deadline` (its wait sleeps)."""

    def __init__(self, work: Any, deadline: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.work = work
        self.deadline = deadline
        self.clock = clock

    def is_completed(self) -> bool:
        """The work completed and the deadline passed."""
        return bool(self.work.is_completed()) and self.clock() >= self.deadline

    def wait(self) -> Any:
        """Wait for the work, then sleep until the deadline."""
        out = self.work.wait()
        left = self.deadline - self.clock()
        if left > 0:
            time.sleep(left)
        return out

    def get_future(self) -> Any:
        """The inner work's future (its completion, not the emulated one)."""
        return self.work.get_future() if hasattr(self.work, "get_future") else self.work.future
