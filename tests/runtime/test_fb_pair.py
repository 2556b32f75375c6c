"""The F&B pair runner: the order work is issued and waited in, parts without exchanges, failures that stop both
parts, the two threads a driver's pairs share, and the backward's deferred weight gradients filling the waits."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch

from duplexpipe.errors import PairAborted
from duplexpipe.runtime.comm_points import Driver, current_driver
from duplexpipe.runtime.fb_pair import run_pair

CPU = torch.device("cpu")


class FakeWork:
    """A posted exchange: reports itself complete from its `after`-th check on."""

    def __init__(self, name: str, after: int = 1) -> None:
        self.name, self.checks, self.after = name, 0, after

    def is_completed(self) -> bool:
        self.checks += 1
        return self.checks >= self.after


def _recording(trace: list[str]) -> Driver:
    """A driver whose (bounded) wait records `wait <the work's name>` in `trace`."""
    return Driver(wait=lambda work, what: trace.append(f"wait {work.name}"))


def _part(name: str, pieces: int, trace: list[str], base: Driver) -> Any:
    """A part computing `pieces` pieces with an exchange between each two."""
    def run() -> None:
        driver = current_driver(base)
        for i in range(pieces):
            trace.append(f"{name} compute {i}")
            if i < pieces - 1:
                driver.exchange(lambda i=i: (trace.append(f"issue {name}{i}"), FakeWork(f"{name}{i}"))[1],
                                f"{name}{i}")
    return run


@pytest.mark.timeout(30)
def test_each_exchange_is_in_flight_while_the_other_part_computes() -> None:
    trace: list[str] = []
    base = _recording(trace)
    run_pair(_part("B", 3, trace, base), _part("F", 3, trace, base), base, CPU)
    assert trace == [
        "B compute 0", "issue B0", "F compute 0", "issue F0",
        "wait B0", "B compute 1", "issue B1", "wait F0", "F compute 1", "issue F1",
        "wait B1", "B compute 2", "wait F1", "F compute 2",
    ]


@pytest.mark.timeout(30)
def test_uneven_parts_and_parts_without_exchanges() -> None:
    trace: list[str] = []
    base = _recording(trace)
    run_pair(_part("B", 1, trace, base), _part("F", 3, trace, base), base, CPU)
    assert trace == ["B compute 0", "F compute 0", "issue F0", "wait F0", "F compute 1", "issue F1", "wait F1",
                     "F compute 2"]
    trace.clear()
    run_pair(_part("B", 1, trace, base), _part("F", 1, trace, base), base, CPU)
    assert trace == ["B compute 0", "F compute 0"]


@pytest.mark.timeout(30)
def test_a_failing_part_stops_the_other_and_raises_once() -> None:
    trace: list[str] = []
    base = _recording(trace)
    stopped: list[str] = []

    def failing() -> None:
        trace.append("F compute 0")
        raise ValueError("boom in the forward")

    def waiting() -> None:
        try:
            _part("B", 3, trace, base)()
        except PairAborted as exc:
            stopped.append(str(exc))
            raise

    with pytest.raises(ValueError, match="boom in the forward"):
        run_pair(waiting, failing, base, CPU)
    assert stopped and "backward stopped at B0" in stopped[0]


@pytest.mark.timeout(30)
def test_a_failing_wait_stops_both_parts() -> None:
    trace: list[str] = []

    def bad_wait(work: Any, what: str) -> None:
        raise RuntimeError(f"peer gone while waiting for {what}")

    base = Driver(wait=bad_wait)
    with pytest.raises(RuntimeError, match="peer gone while waiting for B0"):
        run_pair(_part("B", 3, trace, base), _part("F", 3, trace, base), base, CPU)


@pytest.mark.timeout(30)
def test_pairs_reuse_the_drivers_two_threads_which_end_with_the_driver() -> None:
    base, outside = Driver(), Driver()
    seen: list[int] = []

    def part() -> None:
        seen.append(threading.get_ident())
        current_driver(outside).exchange(lambda: None, "x")  # inside a pair: the part's own driver

    for _ in range(3):
        run_pair(part, part, base, CPU)
    assert len(set(seen)) == 2 and threading.get_ident() not in seen  # the same two threads, every pair
    threads = [t for t in threading.enumerate() if t.ident in seen]
    del base
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.timeout(30)
def test_a_backwards_deferred_weight_gradients_fill_the_waits_in_order_and_the_rest_run_after() -> None:
    trace: list[str] = []
    base = _recording(trace)

    def weights(name: str) -> None:  # as a layer hands them over: formed at once unless a pair takes them
        work = lambda: trace.append(name)  # noqa: E731
        if not current_driver(base).defer(work):
            trace.append(f"{name} at once")

    def backward() -> None:
        trace.append("B compute 0")
        for i in range(3):
            weights(f"W{i}")
        current_driver(base).exchange(lambda: (trace.append("issue B0"), FakeWork("B0", 3))[1], "B0")
        trace.append("B compute 1")

    def forward() -> None:
        trace.append("F compute 0")
        weights("F's W")  # only the backward's are deferred
        current_driver(base).exchange(lambda: (trace.append("issue F0"), FakeWork("F0", 1))[1], "F0")
        trace.append("F compute 1")

    run_pair(backward, forward, base, CPU, defer_weights=True)
    assert trace == ["B compute 0", "issue B0", "F compute 0", "F's W at once", "issue F0",
                     "W0", "W1", "wait B0", "B compute 1", "wait F0", "F compute 1", "W2"]
    trace.clear()
    weights("outside")  # outside a pair: formed where it arises
    run_pair(backward, lambda: None, base, CPU)  # defer_weights off: nothing is deferred
    assert trace[:5] == ["outside at once", "B compute 0", "W0 at once", "W1 at once", "W2 at once"]
