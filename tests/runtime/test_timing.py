"""Tracer (measured compute spans) and timeline merging."""

from __future__ import annotations

import time

import pytest
import torch

from duplexpipe.runtime.timing import Tracer, merge_timelines
from duplexpipe.schedules.ir import Action, Op
from duplexpipe.schedules.timeline import Event, Timeline

CPU = torch.device("cpu")


def test_tracer_records_spans_in_seconds_since_start() -> None:
    tracer = Tracer(rank=2, device=CPU, enabled=True)
    actions = [Action(0, Op.F, 0), Action(0, Op.B, 0)]
    for action in actions:
        with tracer.span(action):
            time.sleep(0.01)
    timeline = tracer.timeline("1f1b", 4, 8)
    assert timeline is not None
    assert (timeline.source, timeline.unit, timeline.num_ranks) == ("measured", "s", 4)
    assert [e.action for e in timeline.events] == actions
    assert all(e.rank == 2 and e.duration >= 0.009 for e in timeline.events)
    assert 0 <= timeline.events[0].start <= timeline.events[0].end <= timeline.events[1].start
    assert Tracer(rank=2, device=CPU, enabled=True).timeline("1f1b", 4, 8).events == ()  # type: ignore[union-attr]


def test_disabled_tracer_returns_none() -> None:
    tracer = Tracer(rank=0, device=CPU, enabled=False)
    with tracer.span(Action(0, Op.F, 0)):
        pass
    assert tracer.timeline("gpipe", 1, 1) is None


def _timeline(rank: int, name: str = "zbv") -> Timeline:
    return Timeline(name, 2, 4, (Event(rank, Action(rank, Op.F, 0), 0.1 * rank, 0.1 * rank + 0.05),),
                    source="measured", unit="s")


def test_merge_keeps_every_event() -> None:
    merged = merge_timelines([_timeline(1), _timeline(0)])
    assert [e.rank for e in merged.events] == [0, 1]
    assert merged.source == "measured" and merged.num_ranks == 2


def test_merge_refuses_different_runs() -> None:
    with pytest.raises(ValueError, match="cannot merge timelines of different runs"):
        merge_timelines([_timeline(0), _timeline(1, name="gpipe")])
    with pytest.raises(ValueError, match="at least one"):
        merge_timelines([])


SPIN_CYCLES = 200_000_000
"""GPU clock cycles a kernel spins for: about 0.1 s on current GPUs (1-2 GHz), while the CPU launches it at once."""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_time_gpu_work_not_the_cpu_clock() -> None:
    """A span around GPU work the CPU only launches: CUDA events measure the work (tens of ms); a CPU clock would
    measure the launch (microseconds), so a tracer that fell back to one fails here."""
    device = torch.device("cuda")
    torch.cuda._sleep(1000)  # the first launch loads the kernel: not part of what is timed
    torch.cuda.synchronize(device)
    tracer = Tracer(rank=0, device=device, enabled=True)
    launched = time.perf_counter()
    with tracer.span(Action(0, Op.F, 0)):
        torch.cuda._sleep(SPIN_CYCLES)
    cpu_s = time.perf_counter() - launched
    timeline = tracer.timeline("gpipe", 1, 1)
    assert timeline is not None
    gpu_s = timeline.events[0].duration
    assert gpu_s >= 0.01 and gpu_s > 10 * cpu_s, (gpu_s, cpu_s)
