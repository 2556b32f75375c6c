"""A `TrainTask`'s batches from any iterable of batches (a `DataLoader`, a streamed dataset): walked in epochs by step,
and held-out batches read once and kept."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from duplexpipe.launch.batches import batch_rows, rows_of

Batch = tuple[Any, Any]
"""(inputs, targets): tensors, or tuples / lists / dicts of them, with the samples in their first dimension."""


def concat_rows(pieces: list[Batch]) -> Batch:
    """The pieces' samples one after another, in one batch of the pieces' structure."""
    if len(pieces) == 1:
        return pieces[0]
    if all(isinstance(p, (tuple, list)) and len(p) == len(pieces[0]) and all(isinstance(t, torch.Tensor) for t in p)
           for p in pieces):  # tensors side by side, the common case, without pytree
        columns = [torch.cat(column) for column in zip(*pieces, strict=True)]
        return columns if isinstance(pieces[0], list) else tuple(columns)  # type: ignore[return-value]
    flat = [tree_flatten(piece) for piece in pieces]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise ValueError(f"the batches differ in structure: {spec} and {next(s for _, s in flat if s != spec)}")
    leaves = [torch.cat([leaves[i] for leaves, _ in flat]) if isinstance(flat[0][0][i], torch.Tensor)
              else flat[0][0][i] for i in range(len(flat[0][0]))]
    return tree_unflatten(leaves, spec)


class _Rows:
    """A stream of samples cut from a stream of batches of any size: `take(n)` the next n as one batch."""

    def __init__(self, batches: Iterator[Batch]) -> None:
        self._batches = batches
        self._current: Batch | None = None
        self._offset = 0
        self._size = 0

    def take(self, count: int, keep: bool = True) -> tuple[list[Batch], int]:
        """Up to `count` next samples (kept as pieces when `keep`) and how many there were (fewer at the end)."""
        pieces: list[Batch] = []
        got = 0
        while got < count:
            if self._offset == self._size:
                self._current = next(self._batches, None)
                if self._current is None:
                    break
                first = self._current[0]
                self._offset = 0
                self._size = int(first.shape[0]) if isinstance(first, torch.Tensor) else batch_rows(first)
                continue
            n = min(count - got, self._size - self._offset)
            if keep:
                assert self._current is not None
                whole = n == self._size
                pieces.append(self._current if whole else rows_of(self._current, self._offset, self._offset + n))
            self._offset += n
            got += n
        return pieces, got


class StreamedBatches:
    """`TrainTask.batch` over an iterable of batches that `epoch_batches(epoch)` makes for each epoch (a
    `DataLoader` whose sampler draws from the epoch, a streamed dataset): step s's batch is samples s x batch_size
    ... of the epochs' samples one after another, whatever size the iterable's batches have (an epoch's last
    samples run on into the next epoch's first).

    Steps are read in order as the run asks for them; a step before the last one read (a resumed run, another
    task instance) reads the epochs again from the start, so step s's batch is the same in every run when
    `epoch_batches(epoch)` gives the same batches for the same epoch (seed its shuffling from the epoch).
    ValueError when an epoch gives no sample."""

    def __init__(self, epoch_batches: Callable[[int], Iterable[Batch]]) -> None:
        self._epoch_batches = epoch_batches
        self._epoch = 0
        self._rows = _Rows(iter(epoch_batches(0)))
        self._epoch_rows = 0
        self._position = 0
        self._last: tuple[int, int, Batch] | None = None

    @property
    def epoch(self) -> int:
        """The epoch the last batch read ended in (0 first)."""
        return self._epoch

    def _restart(self) -> None:
        self._epoch, self._rows, self._epoch_rows, self._position = 0, _Rows(iter(self._epoch_batches(0))), 0, 0

    def _read(self, count: int, keep: bool) -> list[Batch]:
        """The next `count` samples, across epochs."""
        pieces: list[Batch] = []
        while count:
            got_pieces, got = self._rows.take(count, keep)
            pieces += got_pieces
            count -= got
            self._position += got
            self._epoch_rows += got
            if count:
                if self._epoch_rows == 0:
                    raise ValueError(f"the batches of epoch {self._epoch} hold no sample")
                self._epoch += 1
                self._rows, self._epoch_rows = _Rows(iter(self._epoch_batches(self._epoch))), 0
        return pieces

    def __call__(self, step: int, batch_size: int) -> Batch:
        """Step `step`'s batch of `batch_size` samples."""
        if self._last is not None and self._last[:2] == (step, batch_size):
            return self._last[2]
        start = step * batch_size
        if start < self._position:
            self._restart()
        self._read(start - self._position, keep=False)
        batch = concat_rows(self._read(batch_size, keep=True))
        self._last = (step, batch_size, batch)
        return batch


class HeldOutBatches:
    """`TrainTask.eval_batch` over an iterable of held-out batches that `batches()` makes: held-out batch `index`
    is samples index x batch_size ... in the iterable's order, wrapping around at its end. Only the samples asked
    for are read, and kept (evaluation asks for the same first batches each time). ValueError when it holds no
    sample."""

    def __init__(self, batches: Callable[[], Iterable[Batch]]) -> None:
        self._rows = _Rows(iter(batches()))
        self._kept: list[Batch] = []
        self._ended = False

    def has_samples(self) -> bool:
        """Whether the iterable holds a sample (reads up to the first one)."""
        return self._fill(1) > 0

    def _fill(self, count: int) -> int:
        """Samples kept after reading up to `count` of them (fewer when the iterable ends)."""
        while len(self._kept) < count and not self._ended:
            pieces, got = self._rows.take(1)
            if not got:
                self._ended = True
            self._kept += pieces
        return len(self._kept)

    def __call__(self, index: int, batch_size: int) -> Batch:
        """Held-out batch `index` of `batch_size` samples."""
        end = (index + 1) * batch_size
        kept = self._fill(end)
        if kept == 0:
            raise ValueError("the held-out batches hold no sample")
        return concat_rows([self._kept[i % kept] for i in range(index * batch_size, end)])
