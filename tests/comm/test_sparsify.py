"""Tests for duplexpipe.comm.sparsify: fixed slot counts, top-k (per bucket and per tensor), random-k and the
threshold rule."""

from __future__ import annotations

import pytest
import torch

from duplexpipe.comm.sparsify import (
    keep_count,
    largest,
    random_k,
    segment_keep_counts,
    threshold,
    top_k,
    top_k_segments,
)


def test_keep_count_is_fixed_and_clamped() -> None:
    assert keep_count(1000, 0.01) == 10
    assert keep_count(1000, 0.001) == 1
    assert keep_count(10, 0.001) == 1  # never zero slots
    assert keep_count(7, 1.0) == 7
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=f"ratio must be in \\(0, 1\\], got {bad}"):
            keep_count(10, bad)
    with pytest.raises(ValueError, match="empty tensor"):
        keep_count(0, 0.5)


def test_top_k_takes_the_largest_magnitudes() -> None:
    x = torch.tensor([0.1, -5.0, 3.0, -0.2, 4.0, 0.0])
    sel = top_k(x, 3)
    assert sorted(sel.indices.tolist()) == [1, 2, 4]
    assert torch.equal(sel.values, x[sel.indices]) and torch.equal(sel.chosen, sel.indices)
    with pytest.raises(ValueError, match="k must be in \\[1, 6\\], got 7"):
        top_k(x, 7)
    with pytest.raises(ValueError, match="flat"):
        top_k(x.view(2, 3), 1)


@pytest.mark.parametrize("k", [1, 7, 100, 1000, 4000])
def test_largest_is_the_exact_top_k(k: int) -> None:
    """The sampled threshold is only a shortcut: the result is always torch.topk's set."""
    gen = torch.Generator().manual_seed(k)
    mag = torch.randn(200_000, generator=gen).abs()
    assert set(largest(mag, k).tolist()) == set(torch.topk(mag, k).indices.tolist())
    # adversarial: the strided sample sees only large values, so too few entries pass its cut
    stride = max(1, k // 100)
    tricky = torch.rand(200_000, generator=gen)
    tricky[::stride] += 10.0
    tricky[1::stride * 3] += 20.0  # the real top k sits off the sample grid
    assert set(largest(tricky, k).tolist()) == set(torch.topk(tricky, k).indices.tolist())


def test_random_k_draws_distinct_indices_from_its_generator() -> None:
    x = torch.arange(100.0)
    a = random_k(x, 10, torch.Generator().manual_seed(3))
    b = random_k(x, 10, torch.Generator().manual_seed(3))
    c = random_k(x, 10, torch.Generator().manual_seed(4))
    assert torch.equal(a.indices, b.indices) and not torch.equal(a.indices, c.indices)
    assert a.indices.unique().numel() == 10 and torch.equal(a.values, x[a.indices])
    # one per stratum, each index about equally often over many draws
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(100)
    for _ in range(500):
        counts[random_k(x, 10, gen).indices] += 1
    assert counts.min() > 20 and counts.max() < 80  # mean 50, sd about 6.7


def test_threshold_is_theta_times_max_capped_at_k_slots() -> None:
    x = torch.tensor([1.0, -10.0, 6.0, -4.0, 5.0, 0.5])
    sel = threshold(x, 4, 0.5)  # |x| >= 5: -10, 6, 5 (3 of the 4 slots used)
    assert sel.values.numel() == 4 and sel.indices.numel() == 4
    assert sorted(sel.chosen.tolist()) == [1, 2, 4]
    dense = torch.zeros(6).index_add_(0, sel.indices, sel.values)
    assert torch.equal(dense, torch.tensor([0.0, -10.0, 6.0, 0.0, 5.0, 0.0]))  # unused slots add nothing
    capped = threshold(x, 2, 0.1)  # 5 entries pass, only the 2 largest fit
    assert sorted(capped.chosen.tolist()) == [1, 2]
    with pytest.raises(ValueError, match="theta must be in \\[0, 1\\], got 1.5"):
        threshold(x, 2, 1.5)


def test_segment_keep_counts_give_every_tensor_its_own_slots() -> None:
    assert segment_keep_counts([4672, 64, 16384, 0, 1], 0.001) == [5, 1, 16, 0, 1]
    assert segment_keep_counts([100, 7], 1.0) == [100, 7]
    with pytest.raises(ValueError, match="ratio must be in"):
        segment_keep_counts([10], 0.0)


def test_top_k_segments_selects_within_each_tensor() -> None:
    gen = torch.Generator().manual_seed(0)
    numels = [3000, 200, 64, 1]
    scales = [1.0, 1e-3, 1e-4, 1e-5]  # tensors 1000x (and more) smaller than the first
    x = torch.cat([torch.randn(n, generator=gen) * s for n, s in zip(numels, scales, strict=True)])
    ks = segment_keep_counts(numels, 0.01)
    assert ks == [30, 2, 1, 1]
    sel = top_k_segments(x, numels, ks)
    assert torch.equal(sel.values, x[sel.indices]) and torch.equal(sel.chosen, sel.indices)
    offset = 0
    for numel, k in zip(numels, ks, strict=True):
        mine = sel.indices[(sel.indices >= offset) & (sel.indices < offset + numel)]
        want = torch.topk(x[offset:offset + numel].abs(), k).indices + offset
        assert sorted(mine.tolist()) == sorted(want.tolist()), (numel, k)  # the segment's own top k
        offset += numel
    # over the whole bucket, the same 34 slots all go to the first tensor: the small ones starve
    whole = top_k(x, sum(ks))
    assert int((whole.indices >= 3000).sum()) == 0


def test_top_k_segments_rejects_bad_segments() -> None:
    x = torch.arange(10.0)
    with pytest.raises(ValueError, match="do not cover 10 entries"):
        top_k_segments(x, [4, 5], [1, 1])
    with pytest.raises(ValueError, match="do not cover 10 entries"):
        top_k_segments(x, [4, 6], [1])
    with pytest.raises(ValueError, match="k must be in \\[0, 4\\] for a segment of 4 entries, got 5"):
        top_k_segments(x, [4, 6], [5, 1])
    with pytest.raises(ValueError, match="0 slots"):
        top_k_segments(x, [4, 6], [0, 0])
    with pytest.raises(ValueError, match="flat"):
        top_k_segments(x.view(2, 5), [10], [1])
    sel = top_k_segments(x, [4, 0, 6], [0, 0, 2])  # empty tensors and tensors without slots are allowed
    assert sorted(sel.indices.tolist()) == [8, 9]
