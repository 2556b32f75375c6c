"""Comm points inside a stage's compute: the Driver that runs their exchanges, the slot a forward leaves its backward.

A layer that must exchange data in the middle of its forward or backward (an MoE layer's all-to-alls) calls
`slot.driver.exchange(issue, label, nbytes)` at that point. Outside an F&B pair the exchange is issued and waited
for at once; inside one (`fb_pair.run_pair`) the part's own driver hands the collective to the pair, which runs the
other part's next piece while it is in flight.

Which exchange a backward uses is decided when it runs, not when its forward ran: a forward captures its
`CommSlot` (`current_slot()`), and the runtime points the slot at the driver of the code that runs the backward
(`current_driver`). Which gradients a backward computes is not the slot's: the split backward marks the autograd
nodes (`runtime.backward.mode`).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

Issue = Callable[[], Any]
"""Posts a collective (async_op=True) and returns its Work (or None when nothing was sent)."""
Wait = Callable[[Any, str], None]
"""wait(work, what): bounded, failure-aware wait for a posted collective."""


def plain_wait(work: Any, what: str) -> None:
    """Wait for a posted collective, unbounded (outside a runtime)."""
    work.wait()


class Link(Protocol):
    """An emulated link a driver holds its exchanges for (`link_emulator.LinkModel`)."""

    def seconds(self, nbytes: int) -> float:
        """The emulated transfer time of `nbytes`."""
        ...

    def hold(self, start: float, nbytes: int) -> None:
        """Sleep until `start` (perf_counter) + the transfer time of `nbytes`."""
        ...


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

    def __init__(self, wait: Wait = plain_wait, link: Link | None = None,
                 log: list[CommRecord] | None = None) -> None:
        self.wait = wait
        self.link = link
        """An emulated link the exchanges are held for (`link_emulator.emulate_link`); None: real time only."""
        self.log = log
        """Where exchanges are recorded (None: not recorded)."""
        self.pair_workers: tuple[Any, Any] | None = None
        """The two threads that run the parts of this driver's F&B pairs (`fb_pair`), started at its first pair and
        stopped when the driver is garbage-collected."""

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
    exchanges (forward and backward) and loss terms its layers add to the objective."""

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


def use_driver(driver: Driver) -> None:
    """Make `driver` the current one in this context from now on (the context an F&B pair's part runs in)."""
    _DRIVER.set(driver)


@contextlib.contextmanager
def forward_slot(slot: CommSlot) -> Iterator[CommSlot]:
    """Make `slot` the current one while a stage's forward runs."""
    token = _SLOT.set(slot)
    try:
        yield slot
    finally:
        _SLOT.reset(token)
