"""An emulated link for the exchanges inside stage compute (MoE all-to-alls): a benchmarking and testing aid.

On a machine whose real transfers are too fast, or compete with the compute for the cores, overlap figures say
little; holding every exchange for an emulated transfer time (the waiting sleeps, so a core is free meanwhile)
makes them honest. Every figure taken with it must say so. Not part of the everyday configuration: set it on a
built runtime, `emulate_link(pipe.runtime, LinkModel(latency_s=0.002))`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from duplexpipe.runtime.executor import PipelineRuntime


@dataclass(frozen=True)
class LinkModel:
    """An emulated link: a collective completes no earlier than `latency_s + bytes / bandwidth_bytes_per_s`
    after it could start, i.e. after every rank of its group joined it (taken as when its real transfer
    completed: a rank's tokens cannot leave before that rank issued the collective); the waiting sleeps, so a
    core is free meanwhile."""

    latency_s: float = 0.0
    """Seconds added to every transfer."""
    bandwidth_bytes_per_s: float = float("inf")
    """Bytes per second of the link (inf: no bandwidth term)."""

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            raise ValueError(f"LinkModel.latency_s must be >= 0, got {self.latency_s}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"LinkModel.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")

    def seconds(self, nbytes: int) -> float:
        """The emulated transfer time of `nbytes`."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def hold(self, start: float, nbytes: int) -> None:
        """Sleep until `start` (perf_counter) + the transfer time of `nbytes`."""
        left = start + self.seconds(nbytes) - time.perf_counter()
        if left > 0:
            time.sleep(left)


def emulate_link(runtime: PipelineRuntime, link: LinkModel | None) -> None:
    """Hold every exchange `runtime`'s stages make inside their compute (MoE all-to-alls, in F&B pairs or not)
    for `link`: each completes no earlier than latency + bytes / bandwidth after every rank of its group joined
    it. None: the real transfer time only. Every rank of an expert-parallel group should emulate the same link."""
    if link is not None and not isinstance(link, LinkModel):
        raise ValueError(f"emulate_link needs a LinkModel or None, got {link!r}")
    runtime.driver.link = link
