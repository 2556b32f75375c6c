"""Tests for duplexpipe.tp.lane (one process): the dispatch mode lets every other operator through untimed, and its
records become spans on the "tp" lane relative to the step's start. The collectives it times under a real TP mesh
are tested in tests/tp/test_parallelize.py (the lane of a 1F1B step)."""

from __future__ import annotations

import torch

from duplexpipe.schedules.timeline import Span
from duplexpipe.tp.lane import TP_LANE, TPCollectives


def test_other_operators_pass_through_untimed() -> None:
    x = torch.arange(6.0, requires_grad=True)
    with TPCollectives() as lane:
        y = (x * 2).sum()
        y.backward()
    assert y.item() == 30.0 and x.grad is not None and x.grad.eq(2.0).all()
    assert lane.records == [] and lane.spans(0.0, 3) == []


def test_records_become_spans_on_the_tp_lane_relative_to_the_origin() -> None:
    lane = TPCollectives()
    lane.records = [("all_reduce", 10.5, 10.75), ("all_gather_into_tensor", 11.0, 11.5)]
    assert lane.spans(10.0, 2) == [Span(2, TP_LANE, "all_reduce", 0.5, 0.75),
                                   Span(2, TP_LANE, "all_gather_into_tensor", 1.0, 1.5)]
