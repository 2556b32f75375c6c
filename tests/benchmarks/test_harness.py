"""benchmarks.harness: summary statistics, the slowest rank per step, and the GPT harness's data-parallel share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import harness


def test_summarize_quartiles_and_empty() -> None:
    stats = harness.summarize([4.0, 1.0, 3.0, 2.0, 5.0])
    assert stats.median == 3.0 and stats.q1 < stats.median < stats.q3 and stats.n == 5
    assert harness.summarize([2.0, 1.0]).to_dict() == {"median_s": 1.5, "q1_s": 1.0, "q3_s": 2.0, "n": 2}
    with pytest.raises(ValueError, match="at least one sample"):
        harness.summarize([])


def test_a_paired_ratio_cancels_what_falls_on_the_whole_round() -> None:
    base = [0.5, 2.0, 1.0, 0.7, 1.6, 1.2, 0.9, 1.8]  # quartiles of each side overlap widely
    ratio, low, high = harness.paired_ratio([b * 1.05 for b in base], base)
    assert abs(ratio - 1.05) < 1e-12 and abs(low - 1.05) < 1e-12 and abs(high - 1.05) < 1e-12
    ratio, low, high = harness.paired_ratio([b * r for b, r in zip(base, (1.1, 0.9) * 4, strict=True)], base)
    assert low < 1.0 < high and abs(ratio - 1.0) < 1e-12  # noise inside each round: the interval holds 1
    assert harness.quantile([3.0, 1.0, 2.0], 0.0) == 1.0 and harness.quantile([3.0, 1.0, 2.0], 1.0) == 3.0
    with pytest.raises(ValueError, match="at least one round"):
        harness.paired_ratio([], [])


def test_slowest_takes_the_largest_rank_per_step() -> None:
    assert harness.slowest([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]


def test_a_gpt_step_feeds_each_data_parallel_replica_its_share_of_the_batch() -> None:
    x, y = torch.arange(8).view(8, 1), torch.arange(8, 16).view(8, 1)
    task = SimpleNamespace(batch=lambda step, size: (x[:size] + step, y[:size]))
    seen = []

    class _Pipe:
        def __init__(self, dp_rank: int) -> None:
            self.groups = SimpleNamespace(dp_size=2, dp_rank=dp_rank)

        def step(self, a: torch.Tensor, b: torch.Tensor) -> float:
            seen.append((a.flatten().tolist(), b.flatten().tolist()))
            return 0.0

    step = harness.gpt_step(task, 8)
    step(_Pipe(0), 0)  # type: ignore[arg-type]
    step(_Pipe(1), 1)  # type: ignore[arg-type]
    assert seen == [([0, 1, 2, 3], [8, 9, 10, 11]), ([5, 6, 7, 8], [12, 13, 14, 15])]


def test_the_scripted_step_clock_charges_each_stepper_its_cost_in_round_robin_order() -> None:
    clock = harness.ScriptedStepClock([1.0, 10.0, 100.0])
    took = []
    for i in range(3):  # RoundRobin's order: the first stepper rotating, the clock read before and after each step
        for c in ((i + k) % 3 for k in range(3)):
            start = clock()
            took.append((c, clock() - start))
    assert took == [(0, 1.0), (1, 10.0), (2, 100.0), (1, 10.0), (2, 100.0), (0, 1.0), (2, 100.0), (0, 1.0),
                    (1, 10.0)]
