"""Tests for duplexpipe.comm.sparsify: fixed slot counts, top-k, random-k and the threshold rule."""

from __future__ import annotations

import pytest
import torch

from duplexpipe.comm.sparsify import keep_count, largest, random_k, threshold, top_k


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
