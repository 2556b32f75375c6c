"""Comm points inside a stage's compute, and the F&B pair that interleaves two microbatches' pieces.

A layer that must exchange data in the middle of its forward or backward (an MoE layer's all-to-alls)
calls `exchange(issue, label, nbytes)` at that point. Outside a pair the exchange is issued and waited
for at once. Inside an OVERLAP_F_B pair the forward and the backward each run as a coroutine (a thread
that only runs while the other waits, so one thread at a time issues work): at a comm point the
coroutine hands its collective to the pair, which issues it and runs the other microbatch's next
compute piece while it is in flight. Collectives are issued in one deterministic order on every rank.
The two threads live as long as the driver that runs the pairs: a fresh thread per pair would start with a
cold allocator arena (thousands of page faults per pair).

Which exchange a backward uses is decided when it runs, not when its forward ran: a forward captures
its `CommSlot` (`current_slot()`), and the runtime points the slot at the driver of the code that runs
the backward (`bind`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from duplexpipe.errors import PairAborted

Issue = Callable[[], Any]
"""Posts a collective (async_op=True) and returns its Work (or None when nothing was sent)."""
Wait = Callable[[Any, str], None]
"""wait(work, what): bounded, failure-aware wait for a posted collective."""


def plain_wait(work: Any, what: str) -> None:
    """Wait for a posted collective, unbounded (outside a runtime)."""
    work.wait()


@dataclass(frozen=True)
class LinkModel:
    """An emulated link: a collective completes no earlier than `latency_s + bytes / bandwidth_bytes_per_s`
    after it could start, i.e. after every rank of its group joined it (taken as when its real transfer
    completed: a rank's tokens cannot leave before that rank issued the collective); the waiting sleeps, so a
    core is free meanwhile. For honest overlap figures on machines whose real transfers are too fast or
    compete for the cores; every figure taken with it must say so."""

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

    def hold(self, start: float, nbytes: int) -> None:
        """Sleep until `start` (perf_counter) + the transfer time of `nbytes`."""
        left = start + self.seconds(nbytes) - time.perf_counter()
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
        self._workers: tuple[_Worker, _Worker] | None = None

    def workers(self) -> tuple[_Worker, _Worker]:
        """The two threads that run the parts of this driver's pairs (started at the first pair, stopped when
        the driver is garbage-collected)."""
        if self._workers is None:
            self._workers = (_Worker("duplexpipe-backward"), _Worker("duplexpipe-forward"))
            weakref.finalize(self, _Worker.stop_all, self._workers)
        return self._workers

    def post(self, issue: Issue, label: str, nbytes: int = 0) -> Posted:
        """Issue a collective now and return it unwaited (the log records it in issue order). Never a comm point
        of a pair: the caller waits for it in place (`Posted.wait`), for a small exchange whose result the code
        needs soon (token counts), where yielding would pair the other part's long transfer with this part's
        short compute; work done before the wait hides it."""
        issued = time.perf_counter()
        record = CommRecord(label, nbytes, issued, issued)
        if self.log is not None:
            self.log.append(record)
        posted = Posted(self, issue(), record)
        if self.link is not None and hasattr(posted.work, "get_future"):
            posted.work.get_future().add_done_callback(lambda _: posted.joined.append(time.perf_counter()))
        return posted

    def finish(self, posted: Posted) -> None:
        """Wait for a posted exchange (once), holding for the link from when every rank joined it; its record
        gets the time it was seen complete."""
        if posted.done:
            return
        posted.done = True
        record = posted.record
        if posted.work is not None:
            self.wait(posted.work, record.label)
        if self.link is not None:
            start = posted.joined_at()
            self.link.hold(time.perf_counter() if start is None else start, record.nbytes)
        record.done = time.perf_counter()

    def exchange(self, issue: Issue, label: str, nbytes: int = 0) -> None:
        """Issue a collective and return once it completed."""
        self.finish(self.post(issue, label, nbytes))

    def defer(self, work: Callable[[], None]) -> bool:
        """Take weight-gradient work that nothing in this code waits for, to run while an exchange flies; False
        (the caller runs it at once) outside the backward of an F&B pair."""
        return False

    def completed(self, posted: Posted) -> bool:
        """Whether `finish(posted)` would return at once: its transfer is over (and the link's time since every
        rank joined it, if emulated)."""
        if posted.done:
            return True
        if posted.work is not None and not posted.work.is_completed():
            return False
        if self.link is None:
            return True
        start = posted.joined_at()
        return start is not None and time.perf_counter() >= start + self.link.seconds(posted.record.nbytes)


@dataclass
class Posted:
    """A collective issued by `Driver.post`, until its driver's `finish` waited for it."""

    driver: Driver
    work: Any
    """Its Work (None: nothing was sent)."""
    record: CommRecord
    """What was issued and when (also in the driver's log, if it keeps one)."""
    joined: list[float] = field(default_factory=list)
    """When its real transfer completed, i.e. every rank joined it (filled by the Work's future; with a link)."""
    done: bool = False

    def joined_at(self) -> float | None:
        """When every rank had joined it (nothing sent: its issue; None: its Work's future has not said yet)."""
        if self.work is None:
            return self.record.issued
        return self.joined[0] if self.joined else None

    def wait(self) -> None:
        """Wait for it where the caller stands (once; later calls return at once)."""
        self.driver.finish(self)


@dataclass
class CommSlot:
    """What one (stage, microbatch) forward leaves to the runtime beside its output: the driver of its
    exchanges (forward and backward), and loss terms its layers add to the objective."""

    driver: Driver = field(default_factory=Driver)
    """Runs the exchanges; the runtime points it at the driver of whatever code runs the backward."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """Scalar terms a layer adds to the training objective (an MoE balance loss): backward starts each with
    the microbatch's loss weight, like the loss itself, wherever the stage sits in the pipeline."""
    grads: str = "all"
    """Which gradients the backward running now forms: "all", "inputs" (a split backward's I) or "weights" (its
    W); a layer whose backward forms weight gradients itself (`moe.linear`) skips the others."""


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


class _Worker:
    """A long-lived thread that runs the jobs handed to it, one at a time, until stopped."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._loop, args=(self._jobs,), daemon=True, name=name).start()

    @staticmethod
    def _loop(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            job()
            job = None  # holds the pair's parts (and through them the driver) until the next job otherwise

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on this thread (after the jobs before it)."""
        self._jobs.put(job)

    @staticmethod
    def stop_all(workers: tuple[_Worker, ...]) -> None:
        """Let the threads end once their jobs are done."""
        for worker in workers:
            worker._jobs.put(None)


class _Coroutine(Driver):
    """One part of a pair, run on a worker thread; it runs only between `resume()` and its next exchange."""

    def __init__(self, name: str, fn: Callable[[], None], base: Driver, device: torch.device,
                 worker: _Worker) -> None:
        super().__init__(base.wait, base.link, base.log)
        self.name = name
        self.request: tuple[Issue, str, int] | None = None
        self.finished = False
        self.error: BaseException | None = None
        self._abort = False
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        self._ended = threading.Event()
        self.deferred: collections.deque[Callable[[], None]] | None = None
        """Where `defer` puts weight-gradient work (None: it is run where it arises)."""
        context = contextvars.copy_context()
        threads = torch.get_num_threads()
        worker.submit(lambda: context.run(self._main, fn, device, threads))

    def _main(self, fn: Callable[[], None], device: torch.device, threads: int) -> None:
        self._go.acquire()
        try:
            if torch.get_num_threads() != threads:
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
            self._ended.set()

    def exchange(self, issue: Issue, label: str, nbytes: int = 0) -> None:
        """Hand the collective to the pair and sleep until the pair resumes this part (the collective has
        then completed)."""
        self.request = (issue, label, nbytes)
        self._back.release()
        self._go.acquire()
        if self._abort:
            raise PairAborted(f"the other part of the F&B pair failed; {self.name} stopped at {label}")

    def defer(self, work: Callable[[], None]) -> bool:
        if self.deferred is None:
            return False
        self.deferred.append(work)
        return True

    def resume(self) -> None:
        """Run this part until its next exchange or its end."""
        self._go.release()
        self._back.acquire()

    def abort(self) -> None:
        """Unwind this part (at its next exchange) and wait until it has."""
        if not self.finished:
            self._abort = True
            self._go.release()
        self._ended.wait()


def run_pair(first: Callable[[], None], second: Callable[[], None], base: Driver, device: torch.device,
             defer_first: bool = False) -> None:
    """Run two parts interleaved at their comm points: `first` up to its first exchange, which is issued;
    then `second` up to its first, issued; then alternately: wait for a part's exchange and run it on to its
    next one (issued at once), so each exchange is in flight while the other part computes. Parts without
    exchanges run whole, `first` then `second`. Exceptions of either part (or of a wait) are raised here
    after both parts stopped.

    `defer_first` (a full backward): weight gradients `first` defers (`Driver.defer`) run, one at a time
    and in order, while an exchange due next still flies, and the rest after both parts ended: the backward's
    pieces shrink to what the exchanges need, and its weight gradients fill the waits its own exchanges
    would leave (the forward's pieces are too short to hide them)."""
    parts = [_Coroutine("backward" if i == 0 else "forward", fn, base, device, worker)
             for i, (fn, worker) in enumerate(zip((first, second), base.workers(), strict=True))]
    deferred: collections.deque[Callable[[], None]] = collections.deque()
    if defer_first:
        parts[0].deferred = deferred
    inflight: list[Posted | None] = [None, None]
    try:
        turn = 0
        while not all(p.finished for p in parts):
            part = parts[turn]
            if not part.finished:
                pending = inflight[turn]
                if pending is not None:
                    while deferred and not base.completed(pending):
                        deferred.popleft()()
                    base.finish(pending)
                    inflight[turn] = None
                part.resume()
                if part.error is not None:
                    raise part.error
                if not part.finished and part.request is not None:
                    inflight[turn] = base.post(*part.request)
                    part.request = None
            turn = 1 - turn
    finally:
        for part in parts:
            part.abort()
    while deferred:
        deferred.popleft()()
