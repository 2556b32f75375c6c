"""train.planning.calibration's TP collective measurement under shared cores: it runs on a TP group of 2 and
every rank gets rank 0's figure (no timing asserted)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from duplexpipe.train.planning.calibration import tp_collective_work
from tests.models import run_workers


class Ticks:
    """A scripted CPU clock: each read is 1 ms later, so the busy work between collectives takes a fixed count of
    reads, not wall time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def _work(rank: int, world: int) -> list[Any]:
    group = dist.new_group([0, 1])
    found = tp_collective_work(group, 4096, 3e-3, cores=1, rounds=3, repeats=2, cpu_timer=Ticks())
    return [found, tp_collective_work(group, 4, 0.0, cores=8, rounds=2, repeats=1, cpu_timer=Ticks())]


@pytest.mark.timeout(120)
def test_tp_collective_work_is_rank_0s_non_negative_figure_on_every_rank() -> None:
    first, second = run_workers(_work, 2)
    assert first == second, "every rank plans with rank 0's figure"
    assert all(math.isfinite(x) and x >= 0 for x in first)


def test_the_host_link_is_timed_on_cuda_only() -> None:
    from duplexpipe.train.planning.calibration import measure_host_link

    with pytest.raises(ValueError, match="CUDA device's host memory, got device cpu"):
        measure_host_link(torch.device("cpu"))
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    latency, bandwidth = measure_host_link(torch.device("cuda"), nbytes=16 * 2**20, reps=2)
    assert 0 <= latency < 1 and 1e8 < bandwidth < math.inf
