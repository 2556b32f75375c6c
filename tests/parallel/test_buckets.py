"""Tests for duplexpipe.parallel.buckets: bucket plans and readiness (single process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from duplexpipe.parallel.buckets import BucketTracker, final_order, plan_buckets


def _param(numel: int, dtype: torch.dtype = torch.float32, trainable: bool = True) -> nn.Parameter:
    return nn.Parameter(torch.zeros(numel, dtype=dtype), requires_grad=trainable)


def test_buckets_respect_the_limit_and_dtype_in_backward_order() -> None:
    a, b, c, d = _param(10), _param(10), _param(10, torch.float64), _param(30)
    specs = plan_buckets([(0, [a, b, c, d])], bucket_bytes=100)
    assert [[id(p) for p in s.params] for s in specs] == [[id(d)], [id(c)], [id(b), id(a)]]
    assert [s.index for s in specs] == [0, 1, 2]
    assert all(s.nbytes <= 100 or len(s.params) == 1 for s in specs)
    big = plan_buckets([(0, [_param(100)])], bucket_bytes=8)  # a parameter larger than a bucket: alone
    assert len(big) == 1 and big[0].numel == 100


def test_buckets_follow_the_final_order_and_may_span_stages() -> None:
    early, late = [_param(4), _param(4)], [_param(4)]
    specs = plan_buckets([(3, early), (1, late)], bucket_bytes=1000)
    assert len(specs) == 1 and specs[0].stages == {1, 3}
    assert [id(p) for p in specs[0].params] == [id(early[1]), id(early[0]), id(late[0])]
    frozen = plan_buckets([(0, [_param(4, trainable=False), _param(4)])], bucket_bytes=1000)
    assert frozen[0].numel == 4  # parameters without requires_grad are not reduced
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        plan_buckets([(0, early)], 0)


def test_final_order_lists_stages_by_their_last_backward_then_mirrored() -> None:
    assert final_order({7: (2,), 3: (5, 6)}, (0,)) == [5, 6, 2, 0]


def test_tracker_releases_a_bucket_once_all_its_stages_are_final() -> None:
    specs = plan_buckets([(0, [_param(4)]), (1, [_param(4)]), (2, [_param(100)])], bucket_bytes=40)
    assert [set(s.stages) for s in specs] == [{0, 1}, {2}]
    tracker = BucketTracker(specs)
    for _ in range(2):  # the same every step
        tracker.begin()
        assert tracker.ready(0) == []
        assert [s.index for s in tracker.pending()] == [0, 1]
        assert [s.index for s in tracker.ready(1)] == [0]
        assert tracker.ready(1) == []  # each bucket is released once per step
        assert [s.index for s in tracker.ready(2)] == [1] and tracker.pending() == []
