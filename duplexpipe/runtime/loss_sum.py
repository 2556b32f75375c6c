"""One step's loss sum as a rank takes part in it: its losses, its share posted where its plan says, the mean."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from duplexpipe.errors import PipelineError
from duplexpipe.runtime.collectives import PendingSum, SharedSum
from duplexpipe.runtime.watchdog import Watchdog

WHAT = "the loss sum"
"""How waits and errors name it."""


class LossSum:
    """The sum over the ranks of every microbatch's loss times its share of the batch (rows_m / rows), divided by
    `divisor` (the number of pipelines): the mean loss of the step, equal on every rank.

    Created when the step starts (a shared sum's receives are posted then). The ranks holding last stages `add`
    each loss. When a rank posts its share is computed in advance (`RankPlan.losses_final`), so the sum
    completes while the step runs: on gloo right after the action computing the rank's last loss (`post_after`;
    a rank computing none posts at once); on NCCL every rank posts after its list's transfers are done (`post`
    then): a collective in flight during the list can deadlock the first step (with CUDA's lazy module loading,
    the first launch of a kernel waits for the device's queued work, the collective among it, which waits for
    ranks still running their lists, which may wait for this rank's next messages).

    `sources` (gloo only): the ranks holding last stages send their share straight to every rank (`SharedSum`,
    on one pipeline and in evaluate); None: an all-reduce over `group` (`PendingSum`).
    """

    def __init__(self, losses_final: int | None, *, gloo: bool, sources: tuple[int, ...] | None, group: Any,
                 device: torch.device, watchdog: Watchdog, divisor: int = 1) -> None:
        self.post_after = losses_final if gloo else None
        """The position in the list after whose action this rank posts its share (None: not during the list)."""
        self._computes = losses_final is not None
        self._gloo, self._sources, self._group = gloo, sources, group
        self._device, self._watchdog, self._divisor = device, watchdog, divisor
        self._losses: list[Tensor] = []
        self._weights: list[float] = []
        self._pending: PendingSum | None = None
        self._posted = False
        self._shared = SharedSum(sources, group, device, watchdog, WHAT) if sources is not None else None
        if gloo and not self._computes:
            self.post()

    def add(self, loss: Tensor, weight: float) -> None:
        """A microbatch's loss (detached) and its share of the batch."""
        self._losses.append(loss)
        self._weights.append(weight)

    def post(self) -> None:
        """Send this rank's share (once; later calls do nothing): to every rank (a shared sum's source), or into
        the all-reduce."""
        if self._posted:
            return
        self._posted = True
        if self._shared is None:
            self._pending = PendingSum(self._local(), self._group, self._device, self._watchdog, WHAT)
        elif self._computes:
            self._shared.share(self._local())

    def value(self) -> float:
        """The mean loss (the same on every rank); waits for the sum unless done. Re-raises a failed wait."""
        if self._shared is not None:
            return self._shared.value() / self._divisor
        if self._pending is None:
            raise PipelineError(f"{WHAT} was read before this rank posted its share")
        return self._pending.value() / self._divisor

    def _local(self) -> Tensor:
        """This rank's share: its microbatches' weighted losses, or 0."""
        if not self._losses:
            return torch.zeros((), dtype=torch.float64, device=self._device)
        weights = torch.tensor(self._weights, dtype=torch.float64, device=self._device)
        return torch.stack(self._losses).double().mul_(weights).sum()
