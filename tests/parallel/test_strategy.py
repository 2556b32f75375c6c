"""Tests for duplexpipe.parallel.strategy and the strategy factory (single process; training in test_dp.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from duplexpipe.comm import FutureWork
from duplexpipe.parallel import STRATEGY_NAMES, LaneRecorder, check_strategy_name


class _Work:
    """A c10d-like work whose future completes when told."""

    def __init__(self) -> None:
        self.future: torch.futures.Future[Any] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[Any]:
        return self.future


class _NoFuture:
    def get_future(self) -> Any:
        raise RuntimeError("this backend has no futures")


def test_lane_spans_end_at_completion_or_at_the_final_wait() -> None:
    lanes = LaneRecorder()
    c10d, hook = _Work(), FutureWork(torch.futures.Future())
    lanes.start(0, 10.0, c10d)
    lanes.start(1, 10.5, hook)
    lanes.start(2, 11.0, _NoFuture())  # type: ignore[arg-type]
    lanes.start(3, 11.5, None)
    c10d.future.set_result(None)
    hook.future.set_result(None)
    lanes.wait = (1e12, 1e12 + 1.0)
    spans = lanes.spans(origin=10.0, rank=1)
    by_name = {s.name: s for s in spans}
    assert [s.name for s in spans] == ["bucket 0", "bucket 1", "bucket 2", "bucket 3", "wait"]
    assert {s.rank for s in spans} == {1} and {s.lane for s in spans} == {"dp"}
    assert by_name["bucket 0"].start == 0.0 and by_name["bucket 1"].start == 0.5
    # completed by their futures (a perf_counter reading), long before the (fake, far-future) final wait
    assert by_name["bucket 0"].end < 1e12 - 10 and by_name["bucket 1"].end < 1e12 - 10
    assert by_name["bucket 2"].end == by_name["bucket 3"].end == 1e12 + 1.0 - 10.0
    assert by_name["wait"].start == 1e12 - 10.0
    lanes.reset()
    assert lanes.spans(0.0, 0) == []


def test_strategy_names_are_checked() -> None:
    assert STRATEGY_NAMES == ("replicated", "compressed")
    check_strategy_name(None, compressing=True)
    check_strategy_name("compressed", compressing=False)
    with pytest.raises(ValueError, match=r"unknown dp_strategy 'zero1'; expected one of \('replicated'"):
        check_strategy_name("zero1", compressing=False)
