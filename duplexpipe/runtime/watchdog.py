"""Runtime errors, the shared error flag and bounded waits that poll it."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

ERROR_KEY = "error"
_MIN_SLEEP_S = 1e-5
_MAX_SLEEP_S = 2e-3


class PipelineError(RuntimeError):
    """The pipeline runtime could not run a step (the message names the rank and action)."""


class PipelineTimeoutError(PipelineError, TimeoutError):
    """A bounded wait ran out: the message names the rank, the action and the peer."""


class PeerFailedError(PipelineError):
    """Another rank failed; this rank stopped. `failed_rank` is the rank that failed first."""

    def __init__(self, message: str, failed_rank: int) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


class HandshakeError(PipelineError):
    """The ranks of a group do not run the same schedule (or a rank's stages are wrong)."""


class ActivationShapeError(PipelineError, ValueError):
    """A stage produced an activation whose shape or dtype differs from the announced one."""


class Ticket:
    """Completion of Works that a lane thread waits for, in order (`is_completed` without blocking)."""

    def __init__(self, works: list[Any]) -> None:
        self.works: list[Any] | None = works
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        """True once the lane's wait() on every work returned (or one raised)."""
        return self.done.is_set()

    def wait(self) -> None:
        """Re-raise the work's error, if it failed (call after is_completed())."""
        if self.error is not None:
            raise self.error


class WorkGroup:
    """Several Works seen as one: completed when all are; wait() waits for each in order."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        """True when every work has completed."""
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        """Wait for every work (re-raising the first failure)."""
        for work in self.works:
            work.wait()


class Lane:
    """A daemon thread that calls wait() on submitted Works in submission order.

    gloo's point-to-point Works only complete inside wait() (is_completed stays False),
    so a rank that must keep checking the error flag waits for them on a lane and blocks
    on the ticket's event (woken the moment the work completes).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Ticket] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, works: list[Any]) -> Ticket:
        """Queue `works`; their ticket completes when the lane's wait() on each has returned."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        ticket = Ticket(works)
        self._queue.put(ticket)
        return ticket

    def _loop(self) -> None:
        while True:
            ticket = self._queue.get()
            try:
                for work in ticket.works or ():
                    work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting rank
                ticket.error = exc
            # hold no Work while idle: one kept past destroy_process_group keeps gloo's context
            # (and its threads) alive into interpreter exit
            ticket.works = None
            ticket.done.set()
            del ticket


class Watchdog:
    """Bounded waits for one runtime instance, polling an error flag in the c10d store.

    A rank that fails writes `<prefix>/error` (its rank and message); every other rank
    checks that key about every `poll_s` seconds while it waits and raises PeerFailedError.
    With `threaded_p2p` (gloo), Works are waited for on named lane threads (`track`), and a
    wait blocks on the ticket's event, one poll interval at a time.
    """

    def __init__(self, store: Any, prefix: str, rank: int, timeout_s: float, poll_s: float,
                 threaded_p2p: bool = False, flag_rank: int | None = None, flag_label: str = "rank") -> None:
        self.store = store
        self.key = f"{prefix}/{ERROR_KEY}"
        self.rank = rank
        self.flag_rank = rank if flag_rank is None else flag_rank
        """The rank this watchdog's reports name (the global rank when the flag spans several groups)."""
        self.flag_label = flag_label
        """How reports name ranks: "rank", or "global rank" when the flag spans several groups."""
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.threaded_p2p = threaded_p2p
        self._lanes: dict[str, Lane] = {}

    def check(self) -> None:
        """Raise PeerFailedError when some rank has reported a failure."""
        if self.store is None or not self.store.check([self.key]):
            return
        raw = self.store.get(self.key).decode("utf-8", "replace")
        who, _, message = raw.partition("\n")
        failed = int(who) if who.lstrip("-").isdigit() else -1
        me = f"rank {self.rank}" if self.flag_label == "rank" else f"rank {self.rank} (global rank {self.flag_rank})"
        raise PeerFailedError(f"{me}: stopping because {self.flag_label} {failed} failed: {message}", failed)

    def report(self, message: str) -> None:
        """Publish this rank's failure so the other ranks stop (first report wins; never raises)."""
        if self.store is None:
            return
        try:
            if not self.store.check([self.key]):
                self.store.set(self.key, f"{self.flag_rank}\n{message}")
        except Exception:  # noqa: BLE001, S110 - reporting must not mask the original error
            pass

    def wait(self, done: Callable[[], bool], what: str, peer: str, timeout_s: float | None = None) -> None:
        """Poll `done()` until true; check the error flag meanwhile; raise on timeout.

        `what` says what is awaited (naming the action), `peer` whom it is awaited from.
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        deadline, next_check, sleep = start + limit, start + self.poll_s, _MIN_SLEEP_S
        while not done():
            now = time.monotonic()
            if now >= next_check:
                self.check()
                next_check = now + self.poll_s
            if now >= deadline:
                raise PipelineTimeoutError(
                    f"rank {self.rank}: timed out after {limit:g} s waiting for {what} (peer: {peer})")
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP_S)

    def wait_event(self, event: threading.Event, what: str, peer: str) -> None:
        """Block on `event` one poll interval at a time, checking the error flag in between;
        raise PipelineTimeoutError after timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        while not event.wait(max(0.0, min(self.poll_s, deadline - time.monotonic()))):
            self.check()
            if time.monotonic() >= deadline:
                raise PipelineTimeoutError(f"rank {self.rank}: timed out after {self.timeout_s:g} s "
                                           f"waiting for {what} (peer: {peer})")

    def wait_work(self, work: Any, what: str, peer: str) -> None:
        """Wait for a c10d Work or Ticket (bounded, flag-aware), then surface its error if it failed."""
        if work is None:
            return
        if isinstance(work, Ticket):
            self.wait_event(work.done, what, peer)
        else:
            self.wait(work.is_completed, what, peer)
        try:
            work.wait()
        except RuntimeError as exc:
            if isinstance(exc, PipelineError):
                raise
            raise PipelineError(f"rank {self.rank}: {what} failed (peer: {peer}): {exc}") from exc

    def track(self, work: Any, lane: str) -> Any:
        """Something whose is_completed() turns true once `work` (a Work or a list of Works)
        completed (never blocks): with threaded_p2p a Ticket of the lane named `lane` (Works on
        one lane are waited in order), else the work itself (a WorkGroup for a list)."""
        works = work if isinstance(work, list) else [work]
        if not self.threaded_p2p:
            return work if len(works) == 1 else WorkGroup(works)
        if lane not in self._lanes:
            self._lanes[lane] = Lane(f"duplexpipe-{lane}-{self.rank}")
        return self._lanes[lane].submit(works)

    def wait_p2p(self, work: Any, what: str, peer: str) -> None:
        """Wait for a point-to-point Work right now (on the "recv" lane when threaded)."""
        self.wait_work(self.track(work, "recv"), what, peer)

    def track_send(self, work: Any) -> Any:
        """track() on the "send" lane."""
        return self.track(work, "send")
