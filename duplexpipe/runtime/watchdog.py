"""Runtime errors, the shared error flag and bounded waits that check it."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from duplexpipe.errors import PeerFailedError, PipelineError, PipelineTimeoutError

ERROR_KEY = "error"
Text = str | Callable[[], str]
"""A description for error messages, or a function building it (only called when an error needs it)."""
_MIN_SLEEP_S = 1e-5
_MAX_SLEEP_S = 2e-3


class Watchdog:
    """Bounded waits for one runtime instance, checking an error flag in the c10d store.

    A rank that fails writes `<prefix>/error` (its rank and message); every other rank checks
    that key at least every `poll_s` seconds while it waits and raises PeerFailedError.

    With `gloo`, waits block in the Work itself, in the calling thread (no hand-off to another
    thread, so a message wakes its consumer directly). A collective is waited for `poll_s` at a
    time, with the flag checked in between. A point-to-point wait cannot be interrupted (a
    timed-out gloo receive closes the group's connections), so it waits for its whole budget at
    once; a failing rank therefore breaks the group's connections after reporting
    (`MailTransport.poison`), which ends every pending transfer of the group at once, and the
    woken ranks read the flag. Without `gloo` (NCCL), waits poll `is_completed()`.
    """

    def __init__(self, store: Any, prefix: str, rank: int, timeout_s: float, poll_s: float,
                 gloo: bool = False, flag_rank: int | None = None, flag_label: str = "rank") -> None:
        self.store = store
        self.key = f"{prefix}/{ERROR_KEY}"
        self.rank = rank
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.gloo = gloo
        self.flag_rank = rank if flag_rank is None else flag_rank
        """The rank this watchdog's reports name (the global rank when the flag spans several groups)."""
        self.flag_label = flag_label
        """How reports name ranks: "rank", or "global rank" when the flag spans several groups."""

    @property
    def timeout_s(self) -> float:
        """The bound of every wait, in seconds."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_s = value
        self._p2p_limit = timedelta(seconds=value)

    @contextlib.contextmanager
    def patient(self, limit_s: float) -> Iterator[None]:
        """Within the block every wait is bounded by `limit_s` when that is longer than `timeout_s` (a step whose
        ranks compile for minutes); the bound is restored after it."""
        before = self.timeout_s
        self.timeout_s = max(before, limit_s)
        try:
            yield
        finally:
            self.timeout_s = before

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

    def _timeout(self, what: Text, peer: Text, limit: float | None = None) -> PipelineTimeoutError:
        limit = self.timeout_s if limit is None else limit
        return PipelineTimeoutError(f"rank {self.rank}: timed out after {limit:g} s waiting for {_text(what)} "
                                    f"(peer: {_text(peer)})")

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
                raise self._timeout(what, peer, limit)
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP_S)

    def failure(self, exc: RuntimeError, what: Text, peer: Text) -> PipelineError:
        """The error for a Work that failed: a peer's reported failure if there is one (a failing rank
        reports before it breaks the connections), else the failure itself."""
        if isinstance(exc, PipelineError):
            return exc
        deadline = time.monotonic() + min(2.0, 40 * self.poll_s)
        while True:
            try:
                self.check()
            except PeerFailedError as peer_failed:
                return peer_failed
            if time.monotonic() >= deadline or self.store is None:
                break
            time.sleep(0.01)
        return PipelineError(f"rank {self.rank}: {_text(what)} failed (peer: {_text(peer)}): {exc}")

    def wait_p2p(self, works: Any, what: Text, peer: Text) -> None:
        """Wait for point-to-point Works (one or a list), each bounded by timeout_s. `what` and `peer` may be
        functions building the text: a message's wait then formats nothing unless it fails."""
        for work in works if isinstance(works, list) else (works,):
            if not self.gloo:
                self.wait(work.is_completed, _text(what), _text(peer))
            try:
                work.wait(self._p2p_limit) if self.gloo else work.wait()
            except RuntimeError as exc:
                if self.gloo and not isinstance(exc, PipelineError) and "Timed out" in str(exc):
                    self.check()
                    raise self._timeout(what, peer) from None
                raise self.failure(exc, what, peer) from exc

    def wait_collective(self, work: Any, what: str, peer: str) -> None:
        """Wait for a collective Work: bounded by timeout_s, the error flag checked every poll_s."""
        if work is None:
            return
        timed = self.gloo and _takes_timeout(work)
        if not timed:
            self.wait(work.is_completed, what, peer)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                if not timed:
                    work.wait()
                    return
                work.wait(timedelta(seconds=max(1e-3, min(self.poll_s, deadline - time.monotonic()))))
                return
            except RuntimeError as exc:
                if not timed or "timed out" not in str(exc).lower():
                    raise self.failure(exc, what, peer) from exc
            if work.is_completed():  # completed right after the poll interval ended (or failed)
                try:
                    work.wait()
                except RuntimeError as exc:
                    raise self.failure(exc, what, peer) from exc
                return
            self.check()
            if time.monotonic() >= deadline:
                raise self._timeout(what, peer)


def _text(value: Text) -> str:
    return value if isinstance(value, str) else value()


def _takes_timeout(work: Any) -> bool:
    """Whether `work.wait` accepts a timeout (a c10d Work does; a Waitable such as a wrapped Future may
    not, and is then polled through is_completed())."""
    if isinstance(work, dist.Work):
        return True
    try:
        return len(inspect.signature(work.wait).parameters) >= 1
    except (TypeError, ValueError):
        return False
