"""Comm points inside a stage's compute, and the F&B pair that interleaves two microbatches' pieces.

A layer that must exchange data in the middle of its forward or backward (an MoE layer's all-to-alls)
calls `exchange(issue, label, nbytes)` at that point. Outside a pair the exchange is issued and waited
for at once. Inside an OVERLAP_F_B pair the forward and the backward each run as a coroutine (a thread
that only runs while the other waits, so one thread at a time issues work): at a comm point the
coroutine hands its collective to the pair, which issues it and runs the other microbatch's next
compute piece while it is in flight. Collectives are issued in one deterministic order on every rank.

Which exchange a backward uses is decided when it runs, not when its forward ran: a forward captures
its `CommSlot` (`current_slot()`), and the runtime points the slot at the driver of the code that runs
the backward (`bind`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

Issue = Callable[[], Any]
"""Posts a collective (async_op=True) and returns its Work (or None when nothing was sent)."""
Wait = Callable[[Any, str], None]
"""wait(work, what): bounded, failure-aware wait for a posted collective."""


def plain_wait(work: Any, what: str) -> None:
    """Wait for a posted collective, unbounded (outside a runtime)."""
    work.wait()


@dataclass(frozen=True)
class LinkModel:
    """An emulated link: a collective or message completes no earlier than `latency_s + bytes /
    bandwidth_bytes_per_s` after it was issued (the waiting sleeps, so a core is free meanwhile).
    For honest overlap figures on machines whose real transfers are too fast or compete for the
    cores; every figure taken with it must say so."""

    latency_s: float = 0.0
    """Seconds added to every transfer."""
    bandwidth_bytes_per_s: float = float("inf")
    """Bytes per second of the link (inf: no bandwidth term)."""

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            raise ValueError(f"LinkModel.latency_s must be >= 0, got {self.latency_s}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"LinkModel.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")

    def seconds(self, nbytes: int) -> float:
        """The emulated transfer time of `nbytes`."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def hold(self, issued: float, nbytes: int) -> None:
        """Sleep until `issued` (perf_counter) + the transfer time of `nbytes`."""
        left = issued + self.seconds(nbytes) - time.perf_counter()
        if left > 0:
            time.sleep(left)


@dataclass
class CommRecord:
    """One exchange as it ran: what, how many bytes this rank sent, when it was issued and seen complete
    (`done` equals `issued` until it was)."""

    label: str
    nbytes: int
    issued: float
    done: float


class Driver:
    """Runs exchanges: issue, then wait (bounded), holding for the emulated link if any."""

    def __init__(self, wait: Wait = plain_wait, link: LinkModel | None = None,
                 log: list[CommRecord] | None = None) -> None:
        self.wait = wait
        self.link = link
        self.log = log
        """Where exchanges are recorded (None: not recorded)."""

    def start(self, issue: Issue, label: str, nbytes: int) -> tuple[Any, float]:
        """Post the exchange now: (its Work, when it was issued); the log records it in issue order."""
        issued = time.perf_counter()
        if self.log is not None:
            self.log.append(CommRecord(label, nbytes, issued, issued))
        return issue(), issued

    def finish(self, work: Any, issued: float, label: str, nbytes: int) -> None:
        """Wait for a posted exchange; its record gets the time it was seen complete."""
        if work is not None:
            self.wait(work, label)
        if self.link is not None:
            self.link.hold(issued, nbytes)
        if self.log is not None:
            for record in reversed(self.log):
                if record.issued == issued and record.label == label:
                    record.done = time.perf_counter()
                    break

    def exchange(self, issue: Issue, label: str, nbytes: int = 0) -> None:
        """Issue a collective and return once it completed."""
        work, issued = self.start(issue, label, nbytes)
        self.finish(work, issued, label, nbytes)

    def exchange_now(self, issue: Issue, label: str, nbytes: int = 0) -> None:
        """Issue a collective and wait for it in place, never a comm point of a pair: for a small exchange
        whose result the code needs at once (token counts), where yielding would pair the other part's long
        transfer with this part's short compute."""
        Driver.exchange(self, issue, label, nbytes)


@dataclass
class CommSlot:
    """What one (stage, microbatch) forward leaves to the runtime beside its output: the driver of its
    exchanges (forward and backward), and loss terms its layers add to the objective."""

    driver: Driver = field(default_factory=Driver)
    """Runs the exchanges; the runtime points it at the driver of whatever code runs the backward."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """Scalar terms a layer adds to the training objective (an MoE balance loss): backward starts each with
    the microbatch's loss weight, like the loss itself, wherever the stage sits in the pipeline."""


_SLOT: contextvars.ContextVar[CommSlot | None] = contextvars.ContextVar("duplexpipe_comm_slot", default=None)
_DRIVER: contextvars.ContextVar[Driver | None] = contextvars.ContextVar("duplexpipe_driver", default=None)


def current_slot() -> CommSlot:
    """The slot of the forward running now (a fresh plain one outside the runtime: the layer's own
    exchanges are then issued and waited for at once)."""
    slot = _SLOT.get()
    return slot if slot is not None else CommSlot()


def current_driver(default: Driver) -> Driver:
    """The driver of the coroutine running now, else `default`."""
    driver = _DRIVER.get()
    return driver if driver is not None else default


@contextlib.contextmanager
def forward_slot(slot: CommSlot) -> Iterator[CommSlot]:
    """Make `slot` the current one while a stage's forward runs."""
    token = _SLOT.set(slot)
    try:
        yield slot
    finally:
        _SLOT.reset(token)


class PairAborted(RuntimeError):
    """The other part of an F&B pair failed: this part stops at its next comm point."""


class _Coroutine(Driver):
    """One part of a pair, run in its own thread; it runs only between `resume()` and its next exchange."""

    def __init__(self, name: str, fn: Callable[[], None], base: Driver, device: torch.device) -> None:
        super().__init__(base.wait, base.link, base.log)
        self.name = name
        self.request: tuple[Issue, str, int] | None = None
        self.finished = False
        self.error: BaseException | None = None
        self._abort = False
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._main, fn, device, torch.get_num_threads()),
                                        daemon=True, name=f"duplexpipe-{name}")
        self._thread.start()

    def _main(self, fn: Callable[[], None], device: torch.device, threads: int) -> None:
        self._go.acquire()
        try:
            torch.set_num_threads(threads)  # a new thread's OpenMP team would take every core (and spin)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            _DRIVER.set(self)
            if not self._abort:
                fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the pair, which raises it
            self.error = exc
        finally:
            self.finished = True
            self._back.release()

    def exchange(self, issue: Issue, label: str, nbytes: int = 0) -> None:
        """Hand the collective to the pair and sleep until the pair resumes this part (the collective has
        then completed)."""
        self.request = (issue, label, nbytes)
        self._back.release()
        self._go.acquire()
        if self._abort:
            raise PairAborted(f"the other part of the F&B pair failed; {self.name} stopped at {label}")

    def resume(self) -> None:
        """Run this part until its next exchange or its end."""
        self._go.release()
        self._back.acquire()

    def abort(self) -> None:
        """Unwind this part (at its next exchange) and let its thread end."""
        if not self.finished:
            self._abort = True
            self._go.release()
            self._thread.join()


def run_pair(first: Callable[[], None], second: Callable[[], None], base: Driver, device: torch.device) -> None:
    """Run two parts interleaved at their comm points: `first` up to its first exchange, which is issued;
    then `second` up to its first, issued; then alternately: wait for a part's exchange and run it on to its
    next one (issued at once), so each exchange is in flight while the other part computes. Parts without
    exchanges run whole, `first` then `second`. Exceptions of either part (or of a wait) are raised here
    after both parts stopped."""
    parts = [_Coroutine("backward" if i == 0 else "forward", fn, base, device)
             for i, fn in enumerate((first, second))]
    inflight: list[tuple[Any, float, str, int] | None] = [None, None]
    try:
        turn = 0
        while not all(p.finished for p in parts):
            part = parts[turn]
            if not part.finished:
                pending = inflight[turn]
                if pending is not None:
                    base.finish(*pending)
                    inflight[turn] = None
                part.resume()
                if part.error is not None:
                    raise part.error
                if not part.finished and part.request is not None:
                    issue, label, nbytes = part.request
                    part.request = None
                    work, issued = base.start(issue, label, nbytes)
                    inflight[turn] = (work, issued, label, nbytes)
            turn = 1 - turn
    finally:
        for part in parts:
            part.abort()
