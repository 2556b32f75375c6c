"""Comm points: a driver issues, waits and records exchanges, a posted exchange is waited for where the caller asks
(once), and slots and drivers outside a runtime are plain ones."""

from __future__ import annotations

from duplexpipe.runtime.comm_points import (
    CommRecord,
    CommSlot,
    Driver,
    current_driver,
    current_slot,
    forward_slot,
    plain_wait,
)


class FakeWork:
    """A posted exchange, as an issue returns it."""

    def __init__(self, name: str, done: bool = True) -> None:
        self.name, self.done, self.waited = name, done, 0

    def wait(self) -> None:
        self.waited += 1

    def is_completed(self) -> bool:
        return self.done


def _recording(trace: list[str], log: list[CommRecord] | None = None) -> Driver:
    """A driver whose (bounded) wait records `wait <the work's name>` in `trace`."""
    return Driver(wait=lambda work, what: trace.append(f"wait {work.name}"), log=log)


def test_a_posted_exchange_is_waited_for_where_the_caller_asks_and_once() -> None:
    trace: list[str] = []
    log: list[CommRecord] = []
    driver = _recording(trace, log)
    posted = driver.post(lambda: (trace.append("issue"), FakeWork("counts"))[1], "moe counts", 8)
    trace.append("shared experts")
    posted.wait()
    posted.wait()
    assert trace == ["issue", "shared experts", "wait counts"] and [r.label for r in log] == ["moe counts"]


def test_a_plain_exchange_waits_and_records() -> None:
    log: list[CommRecord] = []
    trace: list[str] = []
    driver = _recording(trace, log)
    driver.exchange(lambda: FakeWork("x"), "stage 0 moe 0 dispatch", 64)
    assert trace == ["wait x"] and [(r.label, r.nbytes) for r in log] == [("stage 0 moe 0 dispatch", 64)]
    assert log[0].done >= log[0].issued


def test_an_exchange_that_sent_nothing_is_not_waited_for() -> None:
    trace: list[str] = []
    driver = _recording(trace)
    posted = driver.post(lambda: None, "empty", 0)
    assert driver.completed(posted) and posted.joined_at() == posted.record.issued
    posted.wait()
    assert trace == []


def test_completed_asks_the_work_until_finish_waited() -> None:
    driver = _recording([])
    work = FakeWork("x", done=False)
    posted = driver.post(lambda: work, "x")
    assert not driver.completed(posted)
    work.done = True
    assert driver.completed(posted)
    work.done = False  # once finished, never asked again
    driver.finish(posted)
    assert driver.completed(posted)


def test_plain_wait_waits_for_the_work() -> None:
    work = FakeWork("x")
    plain_wait(work, "x")
    assert work.waited == 1


def test_slots_and_drivers_outside_a_runtime_are_plain() -> None:
    plain = Driver()
    assert current_driver(plain) is plain and not plain.defer(lambda: None)
    assert isinstance(current_slot(), CommSlot) and current_slot() is not current_slot()
    slot = CommSlot()
    assert slot.losses == []
    with forward_slot(slot):
        assert current_slot() is slot
    assert current_slot() is not slot
