"""Tests for duplexpipe.comm.bucket: the GradBucket stand-in's views, buffer replacement and copies."""

from __future__ import annotations

import pytest
import torch

from duplexpipe.comm.bucket import Bucket


def test_gradients_are_views_into_the_buffer() -> None:
    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([6.0, 7.0]), torch.tensor(8.0)]
    bucket = Bucket.of(4, tensors)
    assert bucket.index() == 4 and not bucket.is_last()
    assert torch.equal(bucket.buffer(), torch.arange(9.0))
    views = bucket.gradients()
    assert [tuple(v.shape) for v in views] == [(2, 3), (2,), (1,)]  # 0-d shows as (1,) for PowerSGD
    for v in views:
        v.mul_(2)  # hooks write through the views
    assert torch.equal(bucket.buffer(), torch.arange(9.0) * 2)
    out = [torch.empty_like(t) for t in tensors]
    bucket.store(out)
    assert all(torch.equal(o, 2 * t) for o, t in zip(out, tensors, strict=True))


def test_set_buffer_moves_the_views_and_checks_the_shape() -> None:
    bucket = Bucket(0, [(2,), (3,)], dtype=torch.float64, last=True)
    assert bucket.is_last() and bucket.buffer().dtype == torch.float64
    new = torch.arange(5, dtype=torch.bfloat16)
    bucket.set_buffer(new)
    assert bucket.buffer() is new and bucket.gradients()[1].data_ptr() == new[2:].data_ptr()
    with pytest.raises(ValueError, match=r"new buffer has shape \(4,\), expected \(5,\)"):
        bucket.set_buffer(torch.zeros(4))


def test_bad_buckets_name_the_value() -> None:
    with pytest.raises(ValueError, match="bucket index must be >= 0, got -1"):
        Bucket(-1, [(2,)])
    with pytest.raises(ValueError, match="floating point, got torch.int64"):
        Bucket(0, [(2,)], dtype=torch.int64)
    with pytest.raises(ValueError, match="at least one"):
        Bucket(0, [])
    bucket = Bucket(2, [(2,), (3,)])
    with pytest.raises(ValueError, match=r"bucket 2 holds shapes \[\(2,\), \(3,\)\], got \[\(3,\), \(2,\)\]"):
        bucket.load([torch.zeros(3), torch.zeros(2)])
