"""The emulated link on a scripted clock: transfers queue one after another, a new model applies to what is posted
after it, a held work completes at its deadline; and emulate_sends setting it on a runtime's transport."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from duplexpipe.comm.link import EmulatedLink, HeldWork, LinkModel
from duplexpipe.runtime.link_emulator import emulate_sends


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> str:
        return "done"


def test_transfers_queue_and_a_new_model_applies_to_later_ones() -> None:
    clock = _Clock()
    link = EmulatedLink(LinkModel(latency_s=0.001, bandwidth_bytes_per_s=1e6), clock)
    assert link.deadline(1000) == pytest.approx(0.002)  # 1 ms + 1 ms
    assert link.deadline(2000) == pytest.approx(0.005)  # queued behind the first
    clock.now = 0.010
    link.model = LinkModel(latency_s=0.0, bandwidth_bytes_per_s=1e5)  # the link slows down mid-run
    assert link.deadline(1000) == pytest.approx(0.020)  # posted after the queue drained, at the new bandwidth
    with pytest.raises(ValueError, match="EmulatedLink needs a LinkModel, got 3"):
        EmulatedLink(3)  # type: ignore[arg-type]


def test_a_held_work_completes_at_its_deadline() -> None:
    clock = _Clock()
    held = EmulatedLink(LinkModel(latency_s=0.5), clock).hold(_Done(), 0)
    assert isinstance(held, HeldWork) and held.deadline == 0.5 and not held.is_completed()
    clock.now = 0.5
    assert held.is_completed() and held.wait() == "done"


def test_emulate_sends_sets_the_link_on_the_runtimes_transport() -> None:
    runtime: Any = SimpleNamespace(transport=SimpleNamespace(link=None))
    link = LinkModel(latency_s=0.001)
    emulate_sends(runtime, link)
    assert runtime.transport.link is link
    emulate_sends(runtime, None)
    assert runtime.transport.link is None
    with pytest.raises(ValueError, match="emulate_sends needs a LinkModel or None, got 'fast'"):
        emulate_sends(runtime, "fast")  # type: ignore[arg-type]
