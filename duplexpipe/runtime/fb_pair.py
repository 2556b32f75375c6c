"""The F&B pair runner: a backward and a forward interleaved at their comm points, each on a thread of its own.

Inside an OVERLAP_F_B pair the backward and the forward each run as a coroutine (a thread that only runs while the
other waits, so one thread at a time issues work): at a comm point (`comm_points.Driver.exchange`) the coroutine
hands its collective to the pair, which issues it and runs the other microbatch's next compute piece while it is in
flight. Collectives are issued in one deterministic order on every rank. The two threads live as long as the
driver that runs the pairs: a fresh thread per pair would start with a cold allocator arena (thousands of page
faults per pair).
"""

from __future__ import annotations

import collections
import contextvars
import queue
import threading
import weakref
from collections.abc import Callable

import torch

from duplexpipe.errors import PairAborted
from duplexpipe.runtime.comm_points import Driver, Issue, Posted, use_driver


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


def workers(base: Driver) -> tuple[_Worker, _Worker]:
    """The two threads that run the backward and the forward of `base`'s pairs (started at its first pair, stopped
    when the driver is garbage-collected)."""
    if base.pair_workers is None:
        base.pair_workers = (_Worker("duplexpipe-backward"), _Worker("duplexpipe-forward"))
        weakref.finalize(base, _Worker.stop_all, base.pair_workers)
    backward, forward = base.pair_workers
    return backward, forward


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
            use_driver(self)
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


def run_pair(backward: Callable[[], None], forward: Callable[[], None], base: Driver, device: torch.device, *,
             defer_weights: bool = False) -> None:
    """Run a pair's two parts interleaved at their comm points: `backward` up to its first exchange, which is
    issued (Megatron's combine-B | attention-F: the backward's first exchange hides behind the forward's first
    piece); then `forward` up to its first, issued; then alternately: wait for a part's exchange and run it on to
    its next one (issued at once), so each exchange is in flight while the other part computes. Parts without
    exchanges run whole, `backward` then `forward`. Exceptions of either part (or of a wait) are raised here
    after both parts stopped.

    `defer_weights` (a full backward): weight gradients `backward` defers (`Driver.defer`) run, one at a time
    and in order, while an exchange due next still flies, and the rest after both parts ended: the backward's
    pieces shrink to what the exchanges need, and its weight gradients fill the waits its own exchanges
    would leave (the forward's pieces are too short to hide them)."""
    threads = workers(base)
    parts = (_Coroutine("backward", backward, base, device, threads[0]),
             _Coroutine("forward", forward, base, device, threads[1]))
    deferred: collections.deque[Callable[[], None]] = collections.deque()
    if defer_weights:
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
