"""Count the bytes autograd saves for backward (activations), the yardstick of profiles, plans and steps."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


def storage_key(tensor: Tensor) -> tuple[int, int]:
    """(storage address, storage bytes) of `tensor` (a DTensor: of its local shard); its own extent for tensors
    without a plain storage."""
    local = getattr(tensor, "_local_tensor", None)  # a DTensor holds its local shard, not the global shape
    if isinstance(local, Tensor):
        tensor = local
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(tensor), tensor.numel() * tensor.element_size()


class SavedBytes:
    """The activation bytes of one forward: what it keeps alive until its backward is done.

    The one counting rule shared by `profile_parts` and the runtime's measured peak:
    - every distinct storage autograd saves while `counting()` is active, whole (a saved
      view keeps its entire storage alive), each storage once however often it is saved;
    - plus the input leaves kept for the input-gradient backward (`start(kept=...)`), which
      count once too when autograd also saves them;
    - never parameters (`exclude`, fixed; `live`, read at each forward's first saved tensor:
      FSDP2 swaps gathered parameters onto the module in its pre-forward hook, in storages
      that change between gathers) nor the caller's data (`start(data=...)`: the step's
      inputs and targets, alive anyway).
    """

    def __init__(self, exclude: Iterable[Tensor] = (), live: Callable[[], Iterable[Tensor]] | None = None) -> None:
        self._exclude = {storage_key(t)[0] for t in exclude}
        self._live = live
        self._fresh = False
        """Whether `live` is still to be read for the forward being counted."""
        self._skip: set[int] = set()
        self._seen: dict[int, int] = {}

    @property
    def total(self) -> int:
        """Bytes counted since the last reset or start."""
        return sum(self._seen.values())

    @property
    def storages(self) -> dict[int, int]:
        """What was counted since the last reset or start, storage address -> bytes (each start or reset begins a
        new dict, so the one returned may be kept: the runtime's measured memory unions them per storage)."""
        return self._seen

    def reset(self) -> None:
        """Forget what was counted."""
        self._seen = {}
        self._skip = set()

    def start(self, kept: Iterable[Tensor] = (), data: Iterable[Tensor] = ()) -> None:
        """Begin counting one forward: the input leaves it keeps for backward (`kept`) count,
        storages of the caller's `data` never do."""
        self._seen = {}
        self._skip = {storage_key(t)[0] for t in data}
        self._fresh = self._live is not None
        self.keep(kept)

    def keep(self, tensors: Iterable[Tensor]) -> None:
        """Count `tensors` as kept for backward (input leaves), unless already counted or excluded."""
        for tensor in tensors:
            address, nbytes = storage_key(tensor)
            if address not in self._exclude and address not in self._skip:
                self._seen[address] = nbytes

    def pack(self, tensor: Tensor) -> Tensor:
        """The pack hook: count `tensor`'s storage; returns it detached (another pack hook may call it first)."""
        if self._fresh and self._live is not None:  # the module's parameters as its forward holds them
            self._fresh = False
            self._skip.update(storage_key(t)[0] for t in self._live())
        address, nbytes = storage_key(tensor)  # keep() inlined: this runs for every tensor autograd saves
        if address not in self._exclude and address not in self._skip:
            self._seen[address] = nbytes
        return tensor.detach()  # holding `tensor` itself would make a reference cycle through its grad_fn

    @contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        """Count what autograd saves inside the block.

        Only the innermost saved-tensor hooks run: inside an activation-checkpointed region its
        own hooks apply, so what it recomputes instead of saving is (rightly) not counted; an
        outer hook does not see what is saved inside this block.
        """
        with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
            yield self


def _unpack(tensor: Tensor) -> Tensor:
    return tensor
