"""The adaptive reducer: each bucket reduced by the rung its controller chose, error feedback handed over at a
switch as a codec-independent residual, and every rank's choice agreed over the group after each step."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from duplexpipe.comm.adaptive import CompressionReport, Controller, Decision
from duplexpipe.comm.adaptive_agreement import LAG, Agreement
from duplexpipe.comm.bucket import Bucket
from duplexpipe.comm.hooks import PowerSGDReducer
from duplexpipe.comm.link import EmulatedLink
from duplexpipe.comm.meter import WireMeter
from duplexpipe.comm.reduction import Phases, Reducer, WaitFn
from duplexpipe.dp_options.compression import AdaptiveOptions, Options


def bucket_key(index: int) -> str:
    """The controller's key of gradient bucket `index`."""
    return f"bucket {index}"


RungFactory = Callable[[Options, Any, WireMeter], Reducer]
"""build(options, group, meter): the reducer of one rung (`comm.build.build_reducer`)."""


class AdaptiveReducer(Reducer):
    """Reduces bucket i with the reducer of the rung its controller holds for "bucket i" (one reducer per rung,
    built on first use, all on this reducer's group and meter). A PowerSGD rung's chained all-reduces finish
    before another rung posts on the group.

    At a switch the old rung's error feedback of the bucket is taken out (`Reducer.take_residual`: a flat
    tensor in gradient units) and added, once, to this rank's next gradient of the bucket under the new rung:
    what the old rung held back is sent by the new one, so no gradient mass is lost. A skipped step keeps it
    for the next.

    Every rank of the group makes the same moves at the same step (`comm.adaptive_agreement.Agreement`: `post` at
    a step's end, `settle` at the next step's end)."""

    method = "adaptive"

    def __init__(self, options: AdaptiveOptions, buckets: Sequence[int], build: RungFactory, group: Any = None,
                 meter: WireMeter | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(group, meter)
        self.build = build
        self.options = options
        self.rung_options = options.gradient_rungs()
        self.controller = Controller(options, [bucket_key(i) for i in buckets], lag=LAG, shared=True)
        self.buckets = list(buckets)
        self.clock = clock
        self.carry: dict[int, Tensor] = {}
        """Bucket index -> residual handed over at a switch, added to this rank's next gradient of the bucket."""
        self._rungs: dict[int, Reducer] = {}
        self._rung_link: EmulatedLink | None = None
        self._used: set[int] = set()
        self._consumed: set[int] = set()
        self.agreement = Agreement(self.controller, group, "the data-parallel group", clock)

    def rung_of(self, index: int) -> int:
        """The rung bucket `index` is reduced with now."""
        return self.controller.rung(bucket_key(index))

    def reducer(self, rung: int) -> Reducer:
        """The reducer of `rung` (built on first use)."""
        if rung not in self._rungs:
            built = self.build(self.rung_options[rung], self.group, self.meter)
            built.set_link(self._rung_link)
            self._rungs[rung] = built
        return self._rungs[rung]

    def set_link(self, link: EmulatedLink | None) -> None:
        """The rungs' collectives are held for `link` (this reducer posts none of its own)."""
        super().set_link(link)
        self.link, self._rung_link = None, link
        for rung in self._rungs.values():
            rung.set_link(link)

    def _phases(self, bucket: Bucket) -> Phases:
        index = bucket.index()
        rung = self.rung_of(index)
        inner = self.reducer(rung)
        for other in self._rungs.values():
            busy = other.busy() if isinstance(other, PowerSGDReducer) and other is not inner else None
            if busy is not None:
                yield busy, f"the PowerSGD all-reduces in flight (before gradient bucket {index})"
        carry = self.carry.get(index)
        if carry is not None:
            bucket.buffer().add_(carry.to(bucket.buffer().dtype))
            self._consumed.add(index)
        self._used.add(rung)
        reduction = inner.start(bucket)
        while not reduction.done:
            pending = reduction.pending
            assert pending is not None
            yield pending, reduction.what
            reduction.advance()

    def _close(self, applied: bool) -> None:
        for rung in sorted(self._used):
            self._rungs[rung].end_step(applied)
        if applied:
            for index in self._consumed:
                self.carry.pop(index, None)
        self._used, self._consumed = set(), set()

    def switch(self, moves: list[Decision]) -> None:
        """Hand each moved bucket's error feedback from its old rung to the carry (between steps)."""
        labels = self.controller.labels
        for move in moves:
            index = int(move.key.split()[-1])
            old = self._rungs.get(labels.index(move.before))
            residual = old.take_residual(index) if old is not None else None
            if residual is not None:
                held = self.carry.get(index)
                self.carry[index] = residual if held is None else held.add_(residual.to(held.dtype))

    def post(self, exposed_s: Mapping[int, float], step_s: float, loss: float | None,
             device: torch.device, used: Mapping[str, str] | None = None) -> CompressionReport:
        """End a step: post its measurements for the group's agreement; this step's report."""
        return self.agreement.post({bucket_key(i): t for i, t in exposed_s.items()}, step_s, loss, device, used)

    def finish_step(self, exposed_s: Mapping[int, float], step_s: float, loss: float | None, device: torch.device,
                    wait: WaitFn) -> CompressionReport:
        """End a step: settle the last agreement (moves from the next step), post this step's; its report."""
        used = self.controller.choices()
        self.settle(wait)
        return self.post(exposed_s, step_s, loss, device, used)

    def settle(self, wait: WaitFn) -> list[Decision]:
        """Between steps: complete the last agreement, decide, hand the moved buckets' residuals over; the moves."""
        moves = self.agreement.settle(wait)
        self.switch(moves)
        return moves

    def state_dict(self) -> dict[str, Any]:
        """The controller, the carried residuals and each rung's state (an agreement in flight stays in flight:
        its decisions are made at the next step, as without the checkpoint)."""
        return {**super().state_dict(), "controller": self.controller.state_dict(),
                "carry": {i: t.clone() for i, t in self.carry.items()},
                "rungs": {r: red.state_dict() for r, red in self._rungs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        super().load_state_dict(state)
        self.controller.load_state_dict(state["controller"])
        self.carry = {int(i): t.clone() for i, t in state["carry"].items()}
        for rung, sub in state["rungs"].items():
            self.reducer(int(rung)).load_state_dict(sub)
