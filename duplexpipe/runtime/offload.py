"""Activation offload scheduled from the rank's list: what a forward saves goes to host memory while its backward is
far away and comes back one action before it."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from duplexpipe.config.activations import check_offload as check_offload
from duplexpipe.runtime.stage_compute import Activations
from duplexpipe.schedules.offload import Key, OffloadPlan


def enabled(value: bool | float) -> bool:
    """Whether an `activation_offload` value offloads anything (True, or a fraction)."""
    return value is not False


class Parcel:
    """One storage a forward saved for backward: on the device until offloaded, on host until prefetched, then on
    the device again (a new storage) until autograd drops the last tensor saved from it."""

    __slots__ = ("device", "device_bytes", "host", "event", "nbytes", "address")

    def __init__(self, tensor: Tensor) -> None:
        storage = tensor.untyped_storage()
        self.device = tensor.device
        self.device_bytes: Tensor | None = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        """The storage as bytes while it is on the device."""
        self.host: Tensor | None = None
        """Its copy in host memory while it is away."""
        self.event: torch.cuda.Event | None = None
        """CUDA: the end of the prefetch copy, waited for once by the first unpack."""
        self.nbytes = storage.nbytes()
        self.address = storage.data_ptr()
        """The device storage's address now (a new one once prefetched)."""

    def view(self, dtype: torch.dtype, offset: int, size: torch.Size, stride: tuple[int, ...]) -> Tensor:
        """A saved tensor of this storage, on the device (copied back now if its prefetch was never issued)."""
        if self.device_bytes is None:
            self.fetch(None)
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.event = None
        assert self.device_bytes is not None
        return torch.empty(0, dtype=dtype, device=self.device).set_(self.device_bytes.untyped_storage(), offset,
                                                                     size, stride)

    def offload(self, stream: torch.cuda.Stream | None) -> None:
        """Copy to host (CUDA: a pinned buffer, on `stream`) and let the device storage go."""
        source = self.device_bytes
        assert source is not None
        if stream is None:
            self.host = torch.empty(self.nbytes, dtype=torch.uint8).copy_(source)
        else:
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(stream):
                self.host.copy_(source, non_blocking=True)
            source.record_stream(stream)  # its memory is reused only once the copy read it
        self.device_bytes = None

    def fetch(self, stream: torch.cuda.Stream | None) -> None:
        """Copy back to a new device storage (CUDA: on `stream`, its end an event the first unpack waits for)."""
        host = self.host
        assert host is not None
        target = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        if stream is None:
            target.copy_(host)
        else:
            stream.wait_stream(torch.cuda.current_stream(target.device))  # the new storage is allocated
            with torch.cuda.stream(stream):
                target.copy_(host, non_blocking=True)
                self.event = stream.record_event()
            target.record_stream(stream)
        self.device_bytes, self.host = target, None
        self.address = target.untyped_storage().data_ptr()


Packed = Tensor | tuple[Parcel, torch.dtype, int, torch.Size, tuple[int, ...]]
"""What the pack hook keeps: a tensor it leaves alone, or a parcel and where the saved tensor lies in it."""


def _unpack(packed: Packed) -> Tensor:
    if isinstance(packed, Tensor):
        return packed
    parcel, dtype, offset, size, stride = packed
    return parcel.view(dtype, offset, size, stride)


class Offload:
    """One training step's activation offload on one rank: the saved tensors of each forward in parcels (one per
    storage), moved where `plan` says (`hooks`: what runs after each action). CUDA: pinned host buffers, copies on
    a side `stream`, ordered by waits on the compute stream and by events; CPU: the same moves into separate CPU
    buffers. Exact: the bytes come back as they left."""

    def __init__(self, plan: OffloadPlan, acts: Activations, device: torch.device,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.plan = plan
        self.acts = acts
        self.device = device
        self.stream = stream if device.type == "cuda" else None
        self.parcels: dict[Key, dict[int, Parcel]] = {}
        """(stage, microbatch) -> its parcels by device address, from its F until its B or I starts."""
        self.away: dict[Key, dict[int, int]] = {}
        """(stage, microbatch) -> the storages (address -> bytes) it had on the device that are on host now."""
        self.offloaded_bytes = 0
        """Bytes copied to host in this step."""
        self.prefetched_bytes = 0
        """Bytes copied back to the device in this step."""

    @contextlib.contextmanager
    def saving(self, stage: int, microbatch: int, module: nn.Module, data: Iterable[Tensor] = (),
               count: Callable[[Tensor], Tensor] | None = None) -> Iterator[None]:
        """Inside: what autograd saves goes into parcels of (stage, microbatch), except what offloading would not
        free: the storages of `module`'s parameters and buffers (views of them too) and of the caller's `data`,
        leaves that take gradients, tensor subclasses, other devices' tensors. `count`: the saved-bytes meter's
        pack hook, run first (only the innermost hooks run)."""
        parcels = self.parcels.setdefault((stage, microbatch), {})
        held = itertools.chain(module.parameters(), module.buffers(), data)
        skip = {t.untyped_storage().data_ptr() for t in held if type(t) in (Tensor, nn.Parameter)}
        pack = functools.partial(self._pack, parcels, skip, count)
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield

    def _pack(self, parcels: dict[int, Parcel], skip: set[int], count: Callable[[Tensor], Tensor] | None,
              tensor: Tensor) -> Packed:
        kept = count(tensor) if count is not None else tensor.detach()
        if (isinstance(tensor, nn.Parameter) or (tensor.is_leaf and tensor.requires_grad)
                or type(tensor) is not Tensor or tensor.layout is not torch.strided
                or tensor.device != self.device):
            return kept
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in skip or storage.nbytes() == 0:
            return kept
        parcel = parcels.get(address)
        if parcel is None:
            parcel = parcels[address] = Parcel(tensor)
        return parcel, tensor.dtype, int(tensor.storage_offset()), tensor.size(), tensor.stride()

    def offload(self, key: Key) -> None:
        """Move (stage, microbatch)'s parcels to host; the step's measured activations stop counting them."""
        parcels = self.parcels.get(key)
        if not parcels:
            return
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward produced them
        act = self.acts.held.get(key)
        gone = self.away.setdefault(key, {})
        for parcel in parcels.values():
            if parcel.device_bytes is None:
                continue
            gone[parcel.address] = parcel.nbytes
            if act is not None and act.saved is not None:
                act.saved.pop(parcel.address, None)
            parcel.offload(self.stream)
            self.offloaded_bytes += parcel.nbytes

    def prefetch(self, key: Key) -> None:
        """Start copying (stage, microbatch)'s parcels back; the measured activations count them again."""
        parcels = self.parcels.get(key)
        if not parcels:
            return
        act = self.acts.held.get(key)
        self.away.pop(key, None)
        for parcel in parcels.values():
            if parcel.host is None:
                continue
            parcel.fetch(self.stream)
            self.prefetched_bytes += parcel.nbytes
            if act is not None and act.saved is not None:
                act.saved[parcel.address] = parcel.nbytes

    def backward_starts(self, stage: int, microbatch: int) -> None:
        """B or I of (stage, microbatch) begins: its parcels are autograd's alone from now on (a parcel never
        prefetched comes back at its first unpack)."""
        self.parcels.pop((stage, microbatch), None)
        self.away.pop((stage, microbatch), None)

    def hooks(self) -> dict[int, Callable[[], None]]:
        """Position -> what runs right after that action: the offloads, then the prefetches."""
        out: dict[int, Callable[[], None]] = {}
        for pos in set(self.plan.offload_after) | set(self.plan.prefetch_after):
            out[pos] = functools.partial(self._move, self.plan.offload_after.get(pos, ()),
                                         self.plan.prefetch_after.get(pos, ()))
        return out

    def _move(self, offloads: tuple[Key, ...], prefetches: tuple[Key, ...]) -> None:
        for key in offloads:
            self.offload(key)
        for key in prefetches:
            self.prefetch(key)
