"""The adaptive agreement's per-step cost on a process group of one (counted, on a scripted clock): one collective
posted straight on the group per step, no bounded wait once it completed, and the seconds it reports."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from duplexpipe.comm.adaptive import Controller
from duplexpipe.comm.adaptive_agreement import LAG, Agreement
from duplexpipe.dp_options.compression import AdaptiveOptions

CPU = torch.device("cpu")


class _Work:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        return True


class _Group:
    """A process group of one (the max of one rank's vector is itself), counting the collectives posted on it."""

    def __init__(self, done: bool = True) -> None:
        self.posted: list[Any] = []
        self.done = done

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        self.posted.append(opts.reduceOp)
        return _Work(self.done)


def _run(group: _Group, steps: int) -> tuple[Agreement, list[str], list[str]]:
    ticks = itertools.count()
    controller = Controller(AdaptiveOptions(ladder="none/int8", patience=2), ["bucket 0"], lag=LAG)
    agreement = Agreement(controller, group, "one rank", clock=lambda: next(ticks) * 1e-3)
    waited: list[str] = []
    reports = []
    for _ in range(steps):
        agreement.settle(lambda work, what: waited.append(what))
        reports.append(agreement.post({"bucket 0": 0.5}, 1.0, None, CPU))
    return agreement, waited, [str(d) for r in reports for d in r.decisions] + [
        f"{r.controller_s:.6f}" for r in reports]


def test_one_collective_per_step_and_no_bounded_wait_once_it_completed() -> None:
    group = _Group()
    agreement, waited, out = _run(group, 6)
    assert group.posted == [dist.ReduceOp.MAX] * 6 and waited == []
    assert out[0].startswith("step 2: bucket 0 none -> int8")  # the agreed exposure (50% of the step) moved it
    # the scripted clock advances 1 ms per read: posting reads it twice (1 ms), settling twice (1 ms) from step 2 on
    assert out[-6:] == ["0.001000"] + ["0.002000"] * 5


def test_an_agreement_still_in_flight_is_awaited_bounded() -> None:
    group = _Group(done=False)
    _, waited, _ = _run(group, 3)
    assert waited == ["the adaptive compression's agreement all-reduce over one rank"] * 2


def test_a_forgotten_agreement_decides_nothing() -> None:
    group = _Group()
    controller = Controller(AdaptiveOptions(ladder="none/int8", patience=1), ["bucket 0"])
    agreement = Agreement(controller, group, "one rank")
    agreement.post({"bucket 0": 0.5}, 1.0, None, CPU)
    agreement.forget()
    assert agreement.settle(pytest.fail) == [] and controller.steps == 0
