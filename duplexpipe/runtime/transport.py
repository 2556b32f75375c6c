"""Point-to-point transport: receives posted in schedule order, lazy sends.

Handles are keyed by (op, stage, microbatch); one handle moves a list of tensors (a message's
payloads), posted back to back in list order. Receives from one peer are posted strictly in
the order the schedule lists them (the sender posts in the same order; NCCL matches by order
alone), even when a receive's shape is not known yet: it then waits in a per-peer queue
until its shapes are known (with prefetch off, until its consumer takes it). Sends are
posted at once and awaited lazily; sent tensors are dropped as soon as their sends complete.
On CUDA every transfer is issued on a dedicated stream ordered against the compute stream
with events; nothing synchronizes the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from duplexpipe.comm.meter import WireMeter
from duplexpipe.runtime.stage_compute import TensorMeta
from duplexpipe.runtime.watchdog import PipelineError, Watchdog
from duplexpipe.schedules.ir import Op

Key = tuple[Op, int, int]
"""(op, stage, microbatch) of a SEND or RECV action."""
Resolver = Callable[[bool], "tuple[TensorMeta, ...] | None"]
"""resolve(block): the shapes of a receive's tensors, or None while unknown (block=True waits for them)."""


def key_text(key: Key) -> str:
    """The action text of a handle key, e.g. `1RECV_F3`."""
    op, stage, microbatch = key
    return f"{stage}{op.value}{microbatch}"


@dataclass
class _Recv:
    key: Key
    peer: int
    resolve: Resolver
    buffers: list[Tensor] | None = None
    works: list[Any] | None = None


class Transport:
    """Non-blocking sends and receives of one rank within `group` (ranks are group ranks)."""

    def __init__(self, group: Any, device: torch.device, watchdog: Watchdog, prefetch: bool = True,
                 meter: WireMeter | None = None) -> None:
        self.group = group
        self.meter = meter
        self.device = device
        self.watchdog = watchdog
        self.prefetch = prefetch
        size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(size)]
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._queues: dict[int, deque[_Recv]] = {}
        self._posted: dict[Key, _Recv] = {}
        self._sends: dict[Key, tuple[Any, list[Tensor], int]] = {}

    def _irecv(self, recv: _Recv, metas: tuple[TensorMeta, ...]) -> None:
        src = self._global[recv.peer]
        recv.buffers = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        recv.works = [dist.irecv(b, src=src, group=self.group) for b in recv.buffers]

    def _post(self, recv: _Recv, metas: tuple[TensorMeta, ...]) -> None:
        if self.stream is None:
            self._irecv(recv, metas)
        else:
            with torch.cuda.stream(self.stream):
                self._irecv(recv, metas)
        self._posted[recv.key] = recv

    def _drain(self, peer: int, until: Key | None = None) -> None:
        """Post queued receives from `peer` in order while their shapes are known.

        With `until`, keep going (waiting for shapes) until that receive is posted.
        """
        queue = self._queues.get(peer)
        while queue:
            head = queue[0]
            meta = head.resolve(until is not None)
            if meta is None:
                return
            queue.popleft()
            self._post(head, meta)
            if head.key == until:
                return

    def _check_peer(self, key: Key, peer: int) -> None:
        me = self.watchdog.rank
        if peer == me:
            raise PipelineError(f"rank {me}: {key_text(key)} names rank {me} itself as its peer")
        if not 0 <= peer < len(self._global):
            raise PipelineError(f"rank {me}: {key_text(key)} names rank {peer}, outside the group of "
                                f"{len(self._global)}")

    def expect(self, key: Key, peer: int, resolve: Resolver) -> None:
        """RECV: queue a receive from group rank `peer`; post it as soon as order and shape allow
        (with prefetch off: when its consumer takes it)."""
        self._check_peer(key, peer)
        if key in self._posted or any(r.key == key for r in self._queues.get(peer, ())):
            raise PipelineError(f"rank {self.watchdog.rank}: {key_text(key)} is posted twice")
        self._queues.setdefault(peer, deque()).append(_Recv(key, peer, resolve))
        if self.prefetch:
            self._drain(peer)

    def take(self, key: Key, consumer: str) -> list[Tensor]:
        """Wait (bounded) for the receive `key` and return its tensors; `consumer` names the action."""
        if key not in self._posted:
            queued = next((r for q in self._queues.values() for r in q if r.key == key), None)
            if queued is None:
                raise PipelineError(
                    f"rank {self.watchdog.rank}: {consumer} needs {key_text(key)}, which the schedule "
                    f"did not post before it (is the schedule lowered?)")
            self._drain(queued.peer, until=key)
        recv = self._posted.pop(key)
        assert recv.buffers is not None and recv.works is not None
        works = recv.works if len(recv.works) > 1 else recv.works[0]
        self.watchdog.wait_p2p(works, f"{key_text(key)} (the input of {consumer})", f"rank {recv.peer}")
        if self.stream is not None:
            done = torch.cuda.Event()
            with torch.cuda.stream(self.stream):
                for work in recv.works:
                    work.wait()
                done.record(self.stream)
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            for buffer in recv.buffers:
                buffer.record_stream(compute)
        return recv.buffers

    def send(self, key: Key, tensors: list[Tensor], peer: int) -> None:
        """SEND: post non-blocking sends of `tensors` (in order) to group rank `peer`; completion is
        awaited lazily."""
        self._check_peer(key, peer)
        if key in self._sends:
            raise PipelineError(f"rank {self.watchdog.rank}: {key_text(key)} is posted twice")
        payloads = []
        for tensor in tensors:
            payload = tensor.detach()
            payloads.append(payload if payload.is_contiguous() else payload.contiguous())
        dst = self._global[peer]
        if self.meter is not None:  # one "send" per SEND action: the bytes of all its payloads
            self.meter.record("send", sum(p.numel() * p.element_size() for p in payloads), 2)
        if self.stream is None:
            works = [dist.isend(p, dst=dst, group=self.group) for p in payloads]
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                works = [dist.isend(p, dst=dst, group=self.group) for p in payloads]
            for p in payloads:
                p.record_stream(self.stream)
        tracked = self.watchdog.track(works if len(works) > 1 else works[0], f"send{peer}")
        self._sends[key] = (tracked, payloads, peer)

    def wait_send(self, key: Key) -> None:
        """Wait (bounded) for the send `key` to complete now and release its tensor."""
        if key not in self._sends:
            raise PipelineError(f"rank {self.watchdog.rank}: no pending send {key_text(key)}")
        work, _, peer = self._sends.pop(key)
        self.watchdog.wait_work(work, f"completion of {key_text(key)}", f"rank {peer}")

    def reap(self) -> None:
        """Drop (free) the tensors of sends that have completed."""
        for key in [k for k, (work, _, _) in self._sends.items() if work.is_completed()]:
            work, _, peer = self._sends.pop(key)
            self.watchdog.wait_work(work, f"completion of {key_text(key)}", f"rank {peer}")

    def finish(self) -> None:
        """End of step: wait for every send (bounded); fail on receives nobody consumed."""
        for key, (work, _, peer) in list(self._sends.items()):
            self.watchdog.wait_work(work, f"completion of {key_text(key)} (the peer must post the "
                                    "matching receive)", f"rank {peer}")
            del self._sends[key]
        left = sorted(key_text(k) for k in self._posted) + sorted(
            key_text(r.key) for q in self._queues.values() for r in q)
        if left:
            raise PipelineError(f"rank {self.watchdog.rank}: receives posted but never consumed: {left}")

    @property
    def pending_sends(self) -> int:
        """Sends posted whose completion has not been seen yet (their tensors are still held)."""
        return len(self._sends)

    def global_rank(self, peer: int) -> int:
        """The global rank of group rank `peer`."""
        return self._global[peer]
