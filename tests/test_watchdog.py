"""Bounded waits and the shared error flag: units with a HashStore, then failures across 2 ranks."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import loss_fn, make_batch, make_parts, stage_modules
from torch import nn

from duplexpipe.runtime import (
    ActivationShapeError,
    PeerFailedError,
    PipelineError,
    PipelineRuntime,
    PipelineTimeoutError,
    RuntimeConfig,
)
from duplexpipe.runtime.watchdog import Lane, Watchdog
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

PEER_LIMIT_S = 30.0
"""Every rank must stop within this long after another rank failed (the requirement)."""


def _dog(store: Any, rank: int, timeout_s: float = 5.0) -> Watchdog:
    return Watchdog(store, "test", rank, timeout_s, poll_s=0.01)


def test_report_makes_other_ranks_raise_peer_failed_naming_the_rank() -> None:
    store = dist.HashStore()
    _dog(store, 0).check()  # nothing reported yet
    _dog(store, 2).report("ValueError: boom while running 2F1")
    _dog(store, 3).report("a later failure")  # the first report wins
    with pytest.raises(PeerFailedError) as info:
        _dog(store, 1).check()
    assert info.value.failed_rank == 2
    assert "rank 1: stopping because rank 2 failed: ValueError: boom while running 2F1" in str(info.value)


def test_wait_times_out_naming_rank_action_and_peer() -> None:
    start = time.monotonic()
    with pytest.raises(PipelineTimeoutError, match=r"rank 3: timed out after 0.2 s waiting for "
                                                   r"1RECV_F0 \(the input of 1F0\) \(peer: rank 0\)"):
        _dog(dist.HashStore(), 3, timeout_s=0.2).wait(lambda: False, "1RECV_F0 (the input of 1F0)", "rank 0")
    assert 0.2 <= time.monotonic() - start < 2.0


def test_wait_stops_early_when_a_peer_reports() -> None:
    store = dist.HashStore()
    timer = threading.Timer(0.1, lambda: _dog(store, 0).report("boom"))
    timer.start()
    start = time.monotonic()
    with pytest.raises(PeerFailedError, match="rank 0 failed: boom"):
        _dog(store, 1, timeout_s=30).wait(lambda: False, "something", "rank 0")
    assert time.monotonic() - start < 2.0
    timer.join()


def test_wait_returns_once_done() -> None:
    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    _dog(dist.HashStore(), 0).wait(flag.is_set, "flag", "nobody")
    assert flag.is_set()


class _SlowWork:
    def __init__(self, seconds: float, fail: bool = False) -> None:
        self.seconds, self.fail = seconds, fail

    def wait(self) -> None:
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("transport broke")


def test_lane_completes_tickets_in_order_and_keeps_errors() -> None:
    lane = Lane("test-lane")
    first, second = lane.submit([_SlowWork(0.05)]), lane.submit([_SlowWork(0.0, fail=True)])
    assert not first.is_completed()
    dog = _dog(dist.HashStore(), 0)
    dog.wait_work(first, "first", "nobody")
    with pytest.raises(PipelineError, match="rank 0: second failed \\(peer: rank 9\\): transport broke"):
        dog.wait_work(second, "second", "rank 9")


def test_ticket_wait_wakes_when_the_work_completes_not_at_the_next_poll() -> None:
    dog = Watchdog(dist.HashStore(), "test", 0, timeout_s=30.0, poll_s=5.0, threaded_p2p=True)
    ticket = dog.track(_SlowWork(0.05), "lane")
    start = time.monotonic()
    dog.wait_work(ticket, "slow work", "nobody")
    assert ticket.is_completed()
    assert time.monotonic() - start < 2.0  # a poll interval is 5 s


def test_ticket_wait_stops_when_a_peer_reports_and_times_out() -> None:
    store = dist.HashStore()
    dog = Watchdog(store, "test", 1, timeout_s=30.0, poll_s=0.05, threaded_p2p=True)
    timer = threading.Timer(0.1, lambda: _dog(store, 0).report("boom"))
    timer.start()
    start = time.monotonic()
    with pytest.raises(PeerFailedError, match="rank 0 failed: boom"):
        dog.wait_work(dog.track(_SlowWork(60.0), "stuck"), "something", "rank 0")
    assert time.monotonic() - start < 2.0
    timer.join()
    quiet = Watchdog(dist.HashStore(), "test", 2, timeout_s=0.2, poll_s=0.05, threaded_p2p=True)
    start = time.monotonic()
    with pytest.raises(PipelineTimeoutError, match=r"rank 2: timed out after 0.2 s waiting for 1RECV_B3 "
                                                   r"\(peer: rank 3\)"):
        quiet.wait_work(quiet.track(_SlowWork(60.0), "stuck"), "1RECV_B3", "rank 3")
    assert 0.2 <= time.monotonic() - start < 2.0


def test_track_uses_one_lane_per_name_and_plain_works_without_threads() -> None:
    dog = Watchdog(dist.HashStore(), "test", 0, timeout_s=10.0, poll_s=0.05, threaded_p2p=True)
    slow = dog.track(_SlowWork(1.0), "a")
    behind = dog.track(_SlowWork(0.0), "a")
    other = dog.track(_SlowWork(0.0), "b")
    dog.wait_work(other, "other", "nobody")  # lane "b" does not wait behind lane "a"
    assert not slow.is_completed() and not behind.is_completed()
    dog.wait_work(behind, "behind", "nobody")
    assert slow.is_completed()  # one lane waits in submission order
    work = _SlowWork(0.0)
    assert Watchdog(None, "", 0, 1.0, 0.05).track(work, "a") is work


# ---------------------------------------------------------------- failures across ranks
class _Sleepy(nn.Module):
    """Stalls on one forward call until the peer reported its failure (at most `seconds`), so the
    peer times out however slow the machine is; otherwise behaves."""

    def __init__(self, inner: nn.Module, seconds: float, at_call: int) -> None:
        super().__init__()
        self.inner, self.seconds, self.at_call, self.calls = inner, seconds, at_call, 0
        self.watchdog: Watchdog | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call:
            assert self.watchdog is not None
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline and not self.watchdog.store.check([self.watchdog.key]):
                time.sleep(0.05)
        return self.inner(x)


class _Failing(nn.Module):
    def __init__(self, inner: nn.Module, at_call: int) -> None:
        super().__init__()
        self.inner, self.at_call, self.calls = inner, at_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call:
            raise RuntimeError("boom in the model")
        return self.inner(x)


class _Growing(nn.Module):
    """Returns one more feature column from its second step on (a data-dependent shape bug)."""

    def __init__(self, inner: nn.Module, calls_per_step: int) -> None:
        super().__init__()
        self.inner, self.per_step, self.calls = inner, calls_per_step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.inner(x)
        return torch.cat([out, out[..., :1]], dim=-1) if self.calls > self.per_step else out


def _scenario(rank: int, group: Any, wrap: Any, timeout_s: float, steps: int = 1) -> dict[str, Any]:
    dist.barrier()  # the previous scenario ends at different times on the two ranks
    schedule = lower(build("1f1b", 2, 4))
    modules = stage_modules(schedule, rank, make_parts(2))
    modules = {s: wrap(s, m) for s, m in modules.items()}
    runtime = PipelineRuntime(schedule, modules, loss_fn, group=group,
                              config=RuntimeConfig(timeout_s=timeout_s, poll_interval_s=0.05))
    for module in modules.values():
        if isinstance(module, _Sleepy):
            module.watchdog = runtime.watchdog
    tokens, targets = make_batch(8, 0)
    start = time.monotonic()
    try:
        for _ in range(steps):
            start = time.monotonic()
            runtime.step(tokens if rank == 0 else None, targets if rank == 1 else None)
        result: dict[str, Any] = {"ok": True}
    except Exception as exc:  # noqa: BLE001 - inspected by the tests
        result = {"ok": False, "type": type(exc).__name__, "text": str(exc),
                  "failed_rank": getattr(exc, "failed_rank", None)}
    result["seconds"] = time.monotonic() - start
    try:
        runtime.step(tokens if rank == 0 else None, targets if rank == 1 else None)
        result["after"] = "ran"
    except PipelineError as exc:
        result["after"] = str(exc)
    return result


def _worker(rank: int, world: int) -> dict[str, Any]:
    groups = [dist.new_group([0, 1]) for _ in range(4)]
    return {
        "timeout": _scenario(rank, groups[0], lambda s, m: _Sleepy(m, 60.0, 1) if s == 0 else m, 3.0),
        "timeout_fast": _scenario(rank, groups[3], lambda s, m: _Sleepy(m, 60.0, 5) if s == 0 else m, 3.0,
                                  steps=2),
        "exception": _scenario(rank, groups[1], lambda s, m: _Failing(m, 3) if s == 1 else m, 60.0),
        "shape": _scenario(rank, groups[2], lambda s, m: _Growing(m, 4) if s == 0 else m, 60.0, steps=2),
    }


def test_timeout_names_rank_action_and_peer_and_stops_the_peer(results: Any) -> None:
    waiting, sleeping = results[1]["timeout"], results[0]["timeout"]
    assert waiting["type"] == PipelineTimeoutError.__name__, waiting
    # first step: rank 1 waits for the shape announcement of the activation it receives
    assert ("rank 1: timed out after 3 s waiting for the shape announcement of 1RECV_F0 "
            "(the input of 1F0) (peer: rank 0)") in waiting["text"]
    assert sleeping["type"] == PeerFailedError.__name__ and sleeping["failed_rank"] == 1, sleeping
    assert sleeping["seconds"] < PEER_LIMIT_S


def test_timeout_of_a_receive_with_known_shape(results: Any) -> None:
    waiting, sleeping = results[1]["timeout_fast"], results[0]["timeout_fast"]
    assert waiting["type"] == PipelineTimeoutError.__name__, waiting
    assert "rank 1: timed out after 3 s waiting for 1RECV_F0 (the input of 1F0) (peer: rank 0)" \
        in waiting["text"]
    assert sleeping["type"] == PeerFailedError.__name__ and sleeping["failed_rank"] == 1, sleeping


def test_exception_on_one_rank_ends_every_rank_naming_it(results: Any) -> None:
    failing, other = results[1]["exception"], results[0]["exception"]
    assert failing["type"] == "RuntimeError" and failing["text"] == "boom in the model", failing
    assert other["type"] == PeerFailedError.__name__ and other["failed_rank"] == 1, other
    assert "rank 0: stopping because rank 1 failed: RuntimeError: boom in the model while running 1F2" \
        in other["text"]
    assert other["seconds"] < PEER_LIMIT_S


def test_wrong_activation_shape_names_stage_microbatch_and_shapes(results: Any) -> None:
    producer, consumer = results[0]["shape"], results[1]["shape"]
    assert producer["type"] == ActivationShapeError.__name__, producer
    assert ("stage 0 microbatch 0: the output out has shape (2, 3, 9) float32 but "
            "(2, 3, 8) float32 was expected") in producer["text"]
    assert consumer["type"] == PeerFailedError.__name__ and consumer["failed_rank"] == 0, consumer
    assert consumer["seconds"] < PEER_LIMIT_S


@pytest.mark.parametrize("case", ["timeout", "timeout_fast", "exception", "shape"])
def test_a_failed_runtime_refuses_further_steps(results: Any, case: str) -> None:
    for rank, rec in enumerate(results):
        assert "this PipelineRuntime stopped after an error" in rec[case]["after"], (rank, rec[case])
