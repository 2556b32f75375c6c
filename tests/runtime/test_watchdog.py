"""Bounded waits and the shared error flag: units with a HashStore, then failures across 2 ranks."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import loss_fn, make_batch, make_parts, stage_modules
from torch import nn

from duplexpipe.errors import ActivationShapeError, PeerFailedError, PipelineError, PipelineTimeoutError
from duplexpipe.runtime import PipelineRuntime, RuntimeConfig
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

PEER_LIMIT_S = 30.0
"""Every rank must stop within this long after another rank failed (the requirement)."""
LONG_S = 60.0
"""A limit no wait in these unit tests reaches unless the mechanism under test is broken; checks of
"early" are "< LONG_S / 2", so a loaded machine cannot fail them."""
GENEROUS_S = 60.0
"""The wait limit outside the step a scenario expects to time out."""


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
    assert 0.2 <= time.monotonic() - start < LONG_S / 2


def test_wait_stops_early_when_a_peer_reports() -> None:
    store = dist.HashStore()
    timer = threading.Timer(0.1, lambda: _dog(store, 0).report("boom"))
    timer.start()
    start = time.monotonic()
    with pytest.raises(PeerFailedError, match="rank 0 failed: boom"):
        _dog(store, 1, timeout_s=LONG_S).wait(lambda: False, "something", "rank 0")
    assert time.monotonic() - start < LONG_S / 2
    timer.join()


def test_wait_returns_once_done() -> None:
    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    _dog(dist.HashStore(), 0).wait(flag.is_set, "flag", "nobody")
    assert flag.is_set()


class _Work:
    """A fake c10d Work finishing `seconds` after creation; wait(timeout) behaves like gloo's: a timed-out
    collective stays pending ("Operation timed out!"), a timed-out p2p wait fails ("Timed out waiting")."""

    def __init__(self, seconds: float, error: str = "", p2p: bool = False) -> None:
        self.at, self.error, self.p2p = time.monotonic() + seconds, error, p2p

    def is_completed(self) -> bool:
        return time.monotonic() >= self.at

    def wait(self, timeout: timedelta | None = None) -> bool:
        left = self.at - time.monotonic()
        if timeout is not None and left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Timed out waiting 1ms for recv" if self.p2p else "Operation timed out!")
        time.sleep(max(0.0, left))
        if self.error:
            raise RuntimeError(self.error)
        return True


def _gloo_dog(store: Any, rank: int, timeout_s: float = 30.0, poll_s: float = 0.05) -> Watchdog:
    return Watchdog(store, "test", rank, timeout_s, poll_s, gloo=True)


def test_collective_wait_wakes_when_the_work_completes_not_at_the_next_poll() -> None:
    start = time.monotonic()
    _gloo_dog(dist.HashStore(), 0, poll_s=LONG_S).wait_collective(_Work(0.05), "a sum", "all ranks")
    assert time.monotonic() - start < LONG_S / 2  # a poll interval is LONG_S


def test_collective_wait_stops_when_a_peer_reports_and_times_out() -> None:
    store = dist.HashStore()
    timer = threading.Timer(0.1, lambda: _dog(store, 0).report("boom"))
    timer.start()
    start = time.monotonic()
    with pytest.raises(PeerFailedError, match="rank 0 failed: boom"):
        _gloo_dog(store, 1).wait_collective(_Work(60.0), "something", "rank 0")
    assert time.monotonic() - start < LONG_S / 2
    timer.join()
    start = time.monotonic()
    with pytest.raises(PipelineTimeoutError, match=r"rank 2: timed out after 0.2 s waiting for the loss sum "
                                                   r"\(peer: all ranks\)"):
        _gloo_dog(dist.HashStore(), 2, timeout_s=0.2).wait_collective(_Work(60.0), "the loss sum", "all ranks")
    assert 0.2 <= time.monotonic() - start < LONG_S / 2
    with pytest.raises(PipelineError, match=r"rank 0: the loss sum failed \(peer: rank 9\): transport broke"):
        _gloo_dog(dist.HashStore(), 0).wait_collective(_Work(0.0, "transport broke"), "the loss sum", "rank 9")


class _DoneAtTimeout(_Work):
    """Completes exactly when the first timed wait gives up (the race between a poll interval and completion)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and not self.is_completed():
            self.at = time.monotonic()
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True


def test_collective_completing_as_the_poll_interval_ends_is_a_success_and_its_error_is_kept() -> None:
    _gloo_dog(dist.HashStore(), 0).wait_collective(_DoneAtTimeout(60.0), "a sum", "all ranks")
    with pytest.raises(PipelineError, match="a sum failed .*: broken"):
        _gloo_dog(dist.HashStore(), 0).wait_collective(_DoneAtTimeout(60.0, "broken"), "a sum", "all ranks")


def test_p2p_wait_blocks_in_the_work_and_names_timeouts_and_peer_failures() -> None:
    start = time.monotonic()
    _gloo_dog(dist.HashStore(), 0).wait_p2p([_Work(0.05, p2p=True), _Work(0.1, p2p=True)], "1RECV_F0", "rank 0")
    assert time.monotonic() - start < LONG_S / 2
    with pytest.raises(PipelineTimeoutError, match=r"rank 1: timed out after 0.2 s waiting for 1RECV_B3 "
                                                   r"\(peer: rank 3\)"):
        _gloo_dog(dist.HashStore(), 1, timeout_s=0.2).wait_p2p(_Work(60.0, p2p=True), "1RECV_B3", "rank 3")
    store = dist.HashStore()
    _dog(store, 3).report("ValueError: bad while running 3F1")  # a failing rank reports, then breaks the group
    with pytest.raises(PeerFailedError, match="stopping because rank 3 failed: ValueError: bad") as info:
        _gloo_dog(store, 1).wait_p2p(_Work(0.0, "Connection closed by peer", p2p=True), "1RECV_F2", "rank 0")
    assert info.value.failed_rank == 3
    with pytest.raises(PipelineError, match=r"rank 1: 1RECV_F2 failed \(peer: rank 0\): Connection closed"):
        _gloo_dog(dist.HashStore(), 1, poll_s=0.01).wait_p2p(_Work(0.0, "Connection closed by peer", p2p=True),
                                                            "1RECV_F2", "rank 0")


class _Untimed:
    """A Waitable whose wait() takes no timeout (e.g. a torch Future wrapped by a data-parallel reducer)."""

    def __init__(self, work: _Work) -> None:
        self.work = work

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        return self.work.wait()


def test_a_collective_whose_wait_takes_no_timeout_is_polled_on_gloo_too() -> None:
    dog = _gloo_dog(dist.HashStore(), 0, timeout_s=0.2, poll_s=0.05)
    dog.wait_collective(_Untimed(_Work(0.05)), "a compressed bucket", "all ranks")
    with pytest.raises(PipelineTimeoutError, match="timed out after 0.2 s waiting for a compressed bucket"):
        dog.wait_collective(_Untimed(_Work(60.0)), "a compressed bucket", "all ranks")
    with pytest.raises(PipelineError, match="a compressed bucket failed .*: broken"):
        dog.wait_collective(_Untimed(_Work(0.0, "broken")), "a compressed bucket", "all ranks")


def test_without_gloo_waits_poll_the_work() -> None:
    dog = Watchdog(dist.HashStore(), "test", 0, timeout_s=0.2, poll_s=0.05)
    dog.wait_p2p(_Work(0.05), "a send", "rank 1")
    dog.wait_collective(_Work(0.05), "a sum", "all ranks")
    with pytest.raises(PipelineTimeoutError, match="timed out after 0.2 s waiting for a send"):
        dog.wait_p2p(_Work(60.0), "a send", "rank 1")


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


def _scenario(rank: int, group: Any, wrap: Any, timeout_s: float, steps: int = 1,
              check_every_step: bool = True, device: str = "cpu") -> dict[str, Any]:
    """Run `steps` steps; only the last runs under `timeout_s` (construction and earlier steps get a
    generous limit, so a loaded machine cannot make an earlier wait time out instead)."""
    dist.barrier()  # the previous scenario ends at different times on the two ranks
    schedule = lower(build("1f1b", 2, 4))
    modules = stage_modules(schedule, rank, make_parts(2))
    modules = {s: wrap(s, m.to(device)) for s, m in modules.items()}
    runtime = PipelineRuntime(schedule, modules, loss_fn, group=group,
                              config=RuntimeConfig(timeout_s=max(timeout_s, GENEROUS_S), poll_interval_s=0.05,
                                                   check_inputs_every_step=check_every_step))
    for module in modules.values():
        if isinstance(module, _Sleepy):
            module.watchdog = runtime.watchdog
    tokens, targets = make_batch(8, 0)
    start = time.monotonic()
    try:
        for step in range(steps):
            if step == steps - 1:
                runtime.watchdog.timeout_s = timeout_s
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


SCENARIOS: dict[str, tuple[Any, float, int, bool]] = {
    "timeout": (lambda s, m: _Sleepy(m, 60.0, 1) if s == 0 else m, 3.0, 1, True),
    # step 2 without the step-start agreement: rank 1's first wait of the step is the receive itself
    "timeout_fast": (lambda s, m: _Sleepy(m, 60.0, 5) if s == 0 else m, 3.0, 2, False),
    "exception": (lambda s, m: _Failing(m, 3) if s == 1 else m, 60.0, 1, True),
    "shape": (lambda s, m: _Growing(m, 4) if s == 0 else m, 60.0, 2, True),
}
"""name -> (wrap(stage, module), the last step's wait limit, steps, check_inputs_every_step)."""


def run_scenario(rank: int, name: str, device: str = "cpu") -> dict[str, Any]:
    """One scenario of SCENARIOS on a group of its own."""
    wrap, timeout_s, steps, every = SCENARIOS[name]
    return _scenario(rank, dist.new_group([0, 1]), wrap, timeout_s, steps, every, device)


def _worker(rank: int, world: int) -> dict[str, Any]:
    return {name: run_scenario(rank, name) for name in SCENARIOS}


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
