"""Megatron-style flat buffers for ZeRO-1: tensors laid end to end, cut into shards of ceil(N/DP) elements.

A `FlatLayout` says where each tensor sits in the buffer, which range each data-parallel rank owns, where
that range meets each tensor (`Piece`), and how a piece splits into boxes of the tensor's own shape
(`boxes`: what torch.distributed.checkpoint can store, so a sharded state reloads at any DP size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Where a rank's shard meets one tensor of the buffer."""

    index: int
    """The tensor's position in the buffer."""
    start: int
    """First element of the piece, counted in the tensor's flattened elements."""
    stop: int
    """One past the last element (tensor-flat)."""
    offset: int
    """Where the piece starts inside the shard."""

    @property
    def numel(self) -> int:
        """Elements in the piece."""
        return self.stop - self.start


@dataclass(frozen=True)
class Box:
    """A box of a tensor's shape that is also a contiguous run of its flattened elements."""

    offsets: tuple[int, ...]
    """Index of the box's first corner in every dimension."""
    sizes: tuple[int, ...]
    """Extent in every dimension."""
    start: int
    """The box's first element, tensor-flat (the box covers start .. start + numel)."""

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.sizes)


class FlatLayout:
    """Tensors of `numels` elements end to end, zero-padded to `size` shards of `shard` = ceil(N / size)."""

    def __init__(self, numels: Sequence[int], size: int) -> None:
        if size < 1:
            raise ValueError(f"the data-parallel size must be >= 1, got {size}")
        if any(n < 0 for n in numels):
            raise ValueError(f"tensor sizes must be >= 0, got {list(numels)}")
        self.numels = list(numels)
        self.size = size
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]
        """N: elements of all tensors."""
        self.shard = -(-self.total // size)
        """Elements each rank owns (the last ranks' shards may end in padding)."""
        self.padded = self.shard * size
        """Buffer length: N plus fewer than `size` elements of padding."""

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Buffer positions [lo, hi) that `rank` owns."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside 0..{self.size - 1}")
        return rank * self.shard, (rank + 1) * self.shard

    def pieces(self, rank: int) -> list[Piece]:
        """The non-empty pieces of tensors inside `rank`'s shard, in buffer order."""
        lo, hi = self.shard_range(rank)
        out = []
        for index, numel in enumerate(self.numels):
            begin, end = self.offsets[index], self.offsets[index] + numel
            a, b = max(begin, lo), min(end, hi)
            if a < b:
                out.append(Piece(index, a - begin, b - begin, a - lo))
        return out

    def segments(self) -> list[list[int]]:
        """Per rank, the lengths of the tensors' pieces in its shard, then of its padding if any (int8 blocks
        are cut inside these runs, so two tensors never share a scale)."""
        out = []
        for rank in range(self.size):
            lengths = [p.numel for p in self.pieces(rank)]
            pad = self.shard - sum(lengths)
            out.append(lengths + ([pad] if pad else []))
        return out


def boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Split the flattened (row-major) elements [start, stop) of a tensor of `shape` into boxes.

    Each box is contiguous in memory; at most 2 * (dims - 1) + 1 boxes. A 0-d tensor is one box.
    """
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"range [{start}, {stop}) is outside a tensor of shape {shape}")
    if start == stop:
        return []
    if len(shape) <= 1:
        return [Box((start,) * len(shape), (stop - start,) * len(shape), start)]
    inner = math.prod(shape[1:])
    first, last = -(-start // inner), stop // inner  # whole rows first .. last-1
    out: list[Box] = []
    if first > last:  # inside one row
        return _in_row(shape, start // inner, start % inner, stop % inner or inner, inner)
    if start % inner:
        out += _in_row(shape, start // inner, start % inner, inner, inner)
    if last > first:
        out.append(Box((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:]), first * inner))
    if stop % inner:
        out += _in_row(shape, last, 0, stop % inner, inner)
    return out


def _in_row(shape: tuple[int, ...], row: int, start: int, stop: int, inner: int) -> list[Box]:
    """Boxes of the elements [start, stop) of row `row` (a slice of the first dimension)."""
    return [Box((row, *b.offsets), (1, *b.sizes), row * inner + b.start) for b in boxes(shape[1:], start, stop)]
