"""The mail's point-to-point transport (under the Mailroom): receives posted in schedule order, lazy sends.

Handles are keyed by (op, stage, microbatch); one handle moves a list of tensors (a message's
payloads), posted back to back in list order. Receives from one peer are posted strictly in
the order the schedule lists them (the sender posts in the same order; NCCL matches by order
alone), even when a receive's shape is not known yet: it then waits in a per-peer queue
until its shapes are known (or its consumer takes it). Sends are
posted at once and awaited lazily; sent tensors are dropped as soon as their sends complete.
On CUDA every transfer is issued on a dedicated stream ordered against the compute stream
with events; nothing synchronizes the device.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from duplexpipe.comm.codec import TensorSpec
from duplexpipe.comm.link import EmulatedLink, LinkModel
from duplexpipe.comm.meter import WireMeter
from duplexpipe.errors import PipelineError
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.ir import Op

POISON_TAG = 0x5EED
"""The tag of the receive `MailTransport.poison` times out on (no rank ever sends with it)."""
STAMP = TensorSpec((2,), torch.float64)
"""With stamped sends every message ends with this payload: the sender's wall-clock time (`time.time`) when it posted
the message, and its emulated arrival time (perf_counter seconds, one clock for every process of a machine: the
emulation is a single-machine aid; NaN without an emulated link)."""
WAIT_FLOOR_S = 1e-5
"""Receive waits shorter than this are not recorded (the message was there)."""
Key = tuple[Op, int, int]
"""(op, stage, microbatch) of a SEND or RECV action."""
Resolver = Callable[[bool], "tuple[TensorSpec, ...] | None"]
"""resolve(block): the shapes of a receive's tensors, or None while unknown (block=True waits for them)."""


def key_text(key: Key) -> str:
    """The action text of a handle key, e.g. `1RECV_F3`."""
    op, stage, microbatch = key
    return f"{stage}{op.value}{microbatch}"


def _completion(key: Key) -> str:
    return f"completion of {key_text(key)} (the peer must post the matching receive)"


def _rank(peer: int) -> str:
    return f"rank {peer}"


@dataclass
class _Recv:
    key: Key
    peer: int
    resolve: Resolver
    buffers: list[Tensor] | None = None
    works: list[Any] | None = None


class MailTransport:
    """The mail's non-blocking sends and receives of one rank within `group` (ranks are group ranks)."""

    def __init__(self, group: Any, device: torch.device, watchdog: Watchdog, meter: WireMeter | None = None) -> None:
        self.group = group
        self.meter = meter
        self.device = device
        self.watchdog = watchdog
        size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(size)]
        self._pg: Any = group if group is not None else dist.group.WORLD
        """The process group itself: its send/recv take group ranks and skip torch.distributed's Python
        wrappers (a third of the cost of posting a small message)."""
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._queues: dict[int, deque[_Recv]] = {}
        self._queued: set[Key] = set()
        self._posted: dict[Key, _Recv] = {}
        self._sends: dict[Key, tuple[Any, list[Tensor], int]] = {}
        self.link: LinkModel | None = None
        """An emulated link for the sends (`link_emulator.emulate_sends`; None: real time only)."""
        self._links: dict[int, EmulatedLink] = {}
        self.stamp_sends = False
        """Whether every message carries the time its sender posted it (STAMP; always with an emulated link): set
        alike on every rank of the group, before the first step (adaptive stage sends need the exposed time)."""
        self.clock: Callable[[], float] = time.perf_counter
        """The clock receive waits are timed with (tests script it)."""
        self.wall: Callable[[], float] = time.time
        """The clock of the send stamps, shared by the ranks (on one machine exactly; across machines as far as
        their clocks agree; tests script it)."""
        self.recv_waits: list[tuple[int, float, float]] = []
        """(peer, begin, end) `clock` seconds of every receive this rank blocked on since `reset_waits`, beyond the
        sender's compute: a stamped message's wait begins when its sender posted it, if that was later (the wait
        before it is the sender computing, which no link is to blame for). Unstamped, the whole wait: an upper
        bound of the link's exposed time."""

    def connect(self, pairs: list[tuple[int, int]]) -> None:
        """NCCL: open the connection of every pair of group ranks in `pairs` that holds this rank, with one
        small message each (lower rank to higher), in the order given, before the first step.

        NCCL creates a pair's communicator on the pair's first message, blocking both ranks until both
        arrive. Taken on demand during a step, those creations interleave with the schedule's traffic
        (and allocate on the device while transfers are in flight). Every rank taking the pairs in one
        sorted order cannot deadlock: the smallest pair not yet open has both its ranks waiting on it.
        """
        me = self.watchdog.rank
        probe = torch.zeros(1, device=self.device)
        for low, high in pairs:
            if me not in (low, high):
                continue
            peer = high if me == low else low
            what = f"opening the connection to rank {peer}"
            try:
                work = self._pg.send([probe], peer, 0) if me == low else self._pg.recv([probe], peer, 0)
            except RuntimeError as exc:
                raise self.watchdog.failure(exc, what, f"rank {peer}") from exc
            self.watchdog.wait_p2p(work, what, f"rank {peer}")

    @property
    def stamped(self) -> bool:
        """Whether messages end with STAMP (`stamp_sends` or an emulated link)."""
        return self.stamp_sends or self.link is not None

    def _irecv(self, recv: _Recv, metas: tuple[TensorSpec, ...]) -> None:
        if self.stamped:
            metas = (*metas, STAMP)
        recv.buffers = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        try:
            recv.works = [self._pg.recv([b], recv.peer, 0) for b in recv.buffers]
        except RuntimeError as exc:  # the group's connections are broken: a peer failed (or died)
            raise self.watchdog.failure(exc, f"posting {key_text(recv.key)}", f"rank {recv.peer}") from exc

    def _post(self, recv: _Recv, metas: tuple[TensorSpec, ...]) -> None:
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
            self._queued.discard(head.key)
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
        """RECV: queue a receive from group rank `peer`; post it as soon as order and shape allow."""
        self._check_peer(key, peer)
        if key in self._posted or key in self._queued:
            raise PipelineError(f"rank {self.watchdog.rank}: {key_text(key)} is posted twice")
        self._queued.add(key)
        self._queues.setdefault(peer, deque()).append(_Recv(key, peer, resolve))
        self._drain(peer)

    def take(self, key: Key, consumer: object) -> list[Tensor]:
        """Wait (bounded) for the receive `key` and return its tensors; `consumer` (its str) names the action."""
        if key not in self._posted:
            queued = next((r for q in self._queues.values() for r in q if r.key == key), None)
            if queued is None:
                raise PipelineError(
                    f"rank {self.watchdog.rank}: {consumer} needs {key_text(key)}, which the schedule "
                    f"did not post before it (is the schedule lowered?)")
            self._drain(queued.peer, until=key)
        recv = self._posted.pop(key)
        assert recv.buffers is not None and recv.works is not None
        begin, wall = self.clock(), self.wall()
        self.watchdog.wait_p2p(recv.works, lambda: f"{key_text(key)} (the input of {consumer})",
                               lambda: f"rank {recv.peer}")
        if self.stamped:
            begin += self._arrive(recv, wall)
        end = self.clock()
        if end - begin > WAIT_FLOOR_S:
            self.recv_waits.append((recv.peer, begin, end))
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

    def _arrive(self, recv: _Recv, wall: float) -> float:
        """A stamped message (its last payload): sleep until its emulated arrival, if any; the seconds its sender
        posted it after this rank began waiting at `wall` (0 if before)."""
        assert recv.buffers is not None
        stamp = recv.buffers.pop()
        if self.stream is not None:  # read on the transfer stream (complete), not behind the queued compute
            with torch.cuda.stream(self.stream):
                posted, arrival = stamp.tolist()
        else:
            posted, arrival = stamp.tolist()
        if math.isfinite(arrival):
            left = arrival - time.perf_counter()
            if left > 0:
                time.sleep(left)
        return max(0.0, posted - wall)

    def reset_waits(self) -> None:
        """Forget the receive waits recorded so far (a new step)."""
        self.recv_waits = []

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
        nbytes = sum(p.numel() * p.element_size() for p in payloads)
        if self.meter is not None:  # one "send" per SEND action: the bytes of all its payloads
            self.meter.record("send", nbytes, 2)
        if self.stamped:  # when it was posted; the emulated arrival time, for the receiver to wait until
            arrival = math.nan
            if self.link is not None:
                link = self._links.setdefault(peer, EmulatedLink(self.link))
                link.model = self.link
                arrival = link.deadline(nbytes)
            payloads.append(torch.tensor([self.wall(), arrival], dtype=STAMP.dtype, device=self.device))
        try:
            if self.stream is None:
                works = [self._pg.send([p], peer, 0) for p in payloads]
            else:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    works = [self._pg.send([p], peer, 0) for p in payloads]
                for p in payloads:
                    p.record_stream(self.stream)
        except RuntimeError as exc:  # the group's connections are broken: a peer failed (or died)
            raise self.watchdog.failure(exc, f"posting {key_text(key)}", f"rank {peer}") from exc
        self._sends[key] = (works, payloads, peer)

    def wait_send(self, key: Key) -> None:
        """Wait (bounded) for the send `key` to complete now and release its tensors."""
        if key not in self._sends:
            raise PipelineError(f"rank {self.watchdog.rank}: no pending send {key_text(key)}")
        works, _, peer = self._sends.pop(key)
        self.watchdog.wait_p2p(works, lambda: f"completion of {key_text(key)}", lambda: f"rank {peer}")

    def release(self, keys: tuple[Key, ...]) -> None:
        """Wait for the sends `keys` that are still held (the caller knows they completed: their receiver consumed
        them, so this returns at once) and free their tensors; gloo's way to release sends before `finish`."""
        for key in keys:
            if key in self._sends:
                self.wait_send(key)

    def reap(self) -> None:
        """Drop (free) the tensors of sends seen complete. gloo marks a send complete only once it was
        waited for, so there this is a no-op: sends are released where the schedule proves them complete
        (`release`, RankPlan.sends_done) and the rest by `finish` (the contract's latest point: the end of the
        step)."""
        if self.watchdog.gloo or not self._sends:
            return
        for key in [k for k, (works, _, _) in self._sends.items() if all(w.is_completed() for w in works)]:
            works, _, peer = self._sends.pop(key)
            self.watchdog.wait_p2p(works, f"completion of {key_text(key)}", f"rank {peer}")

    def finish(self) -> None:
        """End of step: wait for every send (bounded); fail on receives nobody consumed."""
        for key, (works, _, peer) in list(self._sends.items()):
            self.watchdog.wait_p2p(works, functools.partial(_completion, key), functools.partial(_rank, peer))
            del self._sends[key]
        left = sorted(key_text(k) for k in self._posted) + sorted(
            key_text(r.key) for q in self._queues.values() for r in q)
        if left:
            raise PipelineError(f"rank {self.watchdog.rank}: receives posted but never consumed: {left}")

    def poison(self) -> None:
        """After a failure on this rank: break the group's gloo connections, so every pending transfer of
        every rank in the group ends at once (they then read the error flag). A gloo receive that times
        out closes all of its group's connections on this rank; this times one out on purpose, on a tag
        nobody sends, trying the peers in turn (a connection a failed peer already closed fails at once
        instead of timing out). A no-op on other backends (their waits poll the flag) and on a group of one."""
        if not self.watchdog.gloo:
            return
        for peer in range(len(self._global)):
            if peer == self.watchdog.rank:
                continue
            try:
                self._pg.recv([torch.empty(1, device=self.device)], peer, POISON_TAG).wait(timedelta(milliseconds=1))
            except Exception as exc:  # noqa: BLE001 - expected: the timeout that broke the group, or a closed pair
                if "timed out" in str(exc).lower():
                    return

    def held(self) -> list[Tensor]:
        """The tensors its transfers hold now: the buffers of receives posted and not yet taken, and the payloads of
        sends not yet released."""
        held = [b for recv in self._posted.values() for b in recv.buffers or ()]
        return held + [p for _, payloads, _ in self._sends.values() for p in payloads]

    @property
    def pending_sends(self) -> int:
        """Sends posted whose completion has not been seen yet (their tensors are still held)."""
        return len(self._sends)

    def global_rank(self, peer: int) -> int:
        """The global rank of group rank `peer`."""
        return self._global[peer]
