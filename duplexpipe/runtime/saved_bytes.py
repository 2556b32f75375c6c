"""Count the bytes autograd saves for backward (activations), the yardstick of profiles and memory plans."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


def storage_key(tensor: Tensor) -> tuple[int, int]:
    """(storage address, storage bytes) of `tensor`; its own extent for tensors without a plain storage."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(tensor), tensor.numel() * tensor.element_size()


class SavedBytes:
    """Sums the distinct storages autograd saves while `counting()` is active, parameters excluded.

    A storage saved by several operations (or viewed several ways) counts once, whole: a
    saved view keeps its entire storage alive. `reset()` starts a new count.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._exclude = {storage_key(t)[0] for t in exclude}
        self._seen: dict[int, int] = {}

    @property
    def total(self) -> int:
        """Bytes counted since the last reset."""
        return sum(self._seen.values())

    def reset(self) -> None:
        """Forget what was counted."""
        self._seen = {}

    def _pack(self, tensor: Tensor) -> Tensor:
        address, nbytes = storage_key(tensor)
        if address not in self._exclude:
            self._seen[address] = nbytes
        return tensor

    @contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        """Count what autograd saves inside the block.

        Only the innermost saved-tensor hooks run: inside an activation-checkpointed region its
        own hooks apply, so what it recomputes instead of saving is (rightly) not counted; an
        outer hook does not see what is saved inside this block.
        """
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield self
