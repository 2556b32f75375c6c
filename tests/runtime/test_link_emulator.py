"""The emulated link: its arithmetic and bad values, how long it holds, the drivers that hold for it (a pair's parts
included), and emulate_link setting it on a runtime's driver."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from duplexpipe.comm.link import LinkModel
from duplexpipe.runtime.comm_points import Driver, current_driver
from duplexpipe.runtime.fb_pair import run_pair
from duplexpipe.runtime.link_emulator import emulate_link


def test_link_model_time_and_bad_values() -> None:
    link = LinkModel(latency_s=0.002, bandwidth_bytes_per_s=1e6)
    assert link.seconds(1000) == pytest.approx(0.003)
    assert LinkModel().seconds(10**9) == 0.0
    with pytest.raises(ValueError, match="latency_s must be >= 0, got -1"):
        LinkModel(latency_s=-1)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be > 0, got 0"):
        LinkModel(bandwidth_bytes_per_s=0)


def test_link_model_holds_at_least_its_time_from_the_issue() -> None:
    link = LinkModel(latency_s=0.02)
    issued = time.perf_counter()
    link.hold(issued, 0)
    assert time.perf_counter() - issued >= 0.02  # a lower bound only: sleeping never ends early
    before = time.perf_counter()
    link.hold(before - 1.0, 0)  # long past: no wait at all is owed
    assert time.perf_counter() - before < 1.0


class _Link:
    """A link that records what it is asked to hold for."""

    def __init__(self) -> None:
        self.held: list[tuple[float, int]] = []

    def seconds(self, nbytes: int) -> float:
        return 1e9  # never over by itself

    def hold(self, start: float, nbytes: int) -> None:
        self.held.append((start, nbytes))


def test_a_driver_holds_each_exchange_for_its_link_from_its_issue_when_nothing_was_sent() -> None:
    link = _Link()
    driver = Driver(link=link)
    posted = driver.post(lambda: None, "x", 64)
    assert not driver.completed(posted)  # the link's time since the issue is not over
    posted.wait()
    assert link.held == [(posted.record.issued, 64)] and driver.completed(posted)


@pytest.mark.timeout(30)
def test_the_parts_of_a_pair_hold_for_their_drivers_link() -> None:
    link = _Link()
    base = Driver(link=link)
    links: list[Any] = []

    def part() -> None:
        links.append(current_driver(base).link)
        current_driver(base).exchange(lambda: None, "x", 8)

    run_pair(part, part, base, torch.device("cpu"))
    assert links == [link, link] and [n for _, n in link.held] == [8, 8]


def test_emulate_link_sets_the_link_on_the_runtimes_driver() -> None:
    runtime: Any = SimpleNamespace(driver=Driver())
    link = LinkModel(latency_s=0.001)
    emulate_link(runtime, link)
    assert runtime.driver.link is link
    emulate_link(runtime, None)
    assert runtime.driver.link is None
    with pytest.raises(ValueError, match="emulate_link needs a LinkModel or None, got 0.002"):
        emulate_link(runtime, 0.002)  # type: ignore[arg-type]
