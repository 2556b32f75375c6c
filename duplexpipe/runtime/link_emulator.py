"""An emulated link for the exchanges inside stage compute (MoE all-to-alls): a benchmarking and testing aid.

On a machine whose real transfers are too fast, or compete with the compute for the cores, overlap figures say
little; holding every exchange for an emulated transfer time (the waiting sleeps, so a core is free meanwhile)
makes them honest. Every figure taken with it must say so. Not part of the everyday configuration: set it on a
built runtime, `emulate_link(pipe.runtime, LinkModel(latency_s=0.002))`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from duplexpipe.comm.link import LinkModel

if TYPE_CHECKING:
    from duplexpipe.runtime.executor import PipelineRuntime

__all__ = ["emulate_link", "emulate_sends"]


def emulate_link(runtime: PipelineRuntime, link: LinkModel | None) -> None:
    """Hold every exchange `runtime`'s stages make inside their compute (MoE all-to-alls, in F&B pairs or not)
    for `link`: each completes no earlier than latency + bytes / bandwidth after every rank of its group joined
    it. None: the real transfer time only. Every rank of an expert-parallel group should emulate the same link."""
    if link is not None and not isinstance(link, LinkModel):
        raise ValueError(f"emulate_link needs a LinkModel or None, got {link!r}")
    runtime.driver.link = link


def emulate_sends(runtime: PipelineRuntime, link: LinkModel | None) -> None:
    """Hold every stage-to-stage message of `runtime` for `link` from the next step on: the sender stamps each message
    with its emulated arrival (latency + bytes / bandwidth after it was posted or the link's previous message to that
    peer arrived, whichever is later) and the receiver waits until then. Call it with the same link on every rank of
    the pipeline, between steps (a new model changes the link during a run); None: real time only. One clock is
    assumed for all processes (perf_counter: one machine)."""
    if link is not None and not isinstance(link, LinkModel):
        raise ValueError(f"emulate_sends needs a LinkModel or None, got {link!r}")
    runtime.transport.link = link
