"""Tests for duplexpipe.parallel.flat: shard ranges, pieces and boxes tile every tensor exactly once."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexpipe.parallel.flat import FlatLayout, boxes

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(0, 40), min_size=1, max_size=6), size=st.integers(1, 5))
def test_shards_are_ceil_n_over_dp_and_pieces_tile_every_tensor(numels: list[int], size: int) -> None:
    layout = FlatLayout(numels, size)
    assert layout.shard == math.ceil(sum(numels) / size)
    assert 0 <= layout.padded - layout.total < size  # under one element of padding per rank
    seen = [[0] * n for n in numels]
    for rank in range(size):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard
        for piece in layout.pieces(rank):
            assert piece.numel > 0
            begin = layout.offsets[piece.index] + piece.start
            assert lo + piece.offset == begin  # the piece sits where the buffer holds those elements
            for k in range(piece.start, piece.stop):
                seen[piece.index][k] += 1
    assert all(count == 1 for counts in seen for count in counts)


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(0, 40), min_size=1, max_size=6), size=st.integers(1, 5))
def test_segments_are_each_ranks_pieces_then_its_padding(numels: list[int], size: int) -> None:
    layout = FlatLayout(numels, size)
    segments = layout.segments()
    assert len(segments) == size
    for rank, lengths in enumerate(segments):
        assert sum(lengths) == layout.shard and all(n > 0 for n in lengths), (rank, lengths)
        pieces = [p.numel for p in layout.pieces(rank)]
        assert lengths[:len(pieces)] == pieces and len(lengths) - len(pieces) <= 1


@settings(max_examples=300, deadline=None)
@given(shape=shapes, data=st.data())
def test_boxes_tile_a_range_and_are_contiguous_runs(shape: tuple[int, ...], data: st.DataObject) -> None:
    total = math.prod(shape)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    found = boxes(shape, start, stop)
    assert len(found) <= max(1, 2 * (len(shape) - 1) + 1)
    ids = torch.arange(total).reshape(shape)
    covered = []
    for box in found:
        index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))
        block = ids[index].reshape(-1)
        assert block.tolist() == list(range(box.start, box.start + box.numel))  # contiguous, in order
        covered += block.tolist()
    assert covered == list(range(start, stop))


def test_a_scalar_tensor_is_one_box() -> None:
    assert [(b.offsets, b.sizes, b.start) for b in boxes((), 0, 1)] == [((), (), 0)]


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        FlatLayout([3], 0)
    with pytest.raises(ValueError, match=r"range \[2, 9\) is outside a tensor of shape \(2, 3\)"):
        boxes((2, 3), 2, 9)
    with pytest.raises(ValueError, match="rank 3 is outside 0..1"):
        FlatLayout([3], 2).shard_range(3)
