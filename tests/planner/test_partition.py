"""Tests for duplexpipe.planner.partition: the one contiguous-partition algorithm (the planner's grouping of
profiled parts and model.split's "params" / "time" balance both use it)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexpipe.planner.partition import balanced_split


def test_balanced_split_minimises_the_largest_run() -> None:
    assert balanced_split([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balanced_split([1, 2, 3], 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="cannot split 2 parts into 3 groups"):
        balanced_split([1, 1], 3)
    with pytest.raises(ValueError, match="cannot split 2 parts into 0 groups"):
        balanced_split([1, 1], 0)


def test_ties_go_to_shorter_early_runs() -> None:
    assert balanced_split([1, 1, 1], 2) == [1, 2]
    assert balanced_split([0.0, 0.0, 0.0, 0.0], 2) == [1, 3]


@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=9), st.integers(1, 9))
@settings(max_examples=60, deadline=None)
def test_balanced_split_is_optimal(costs: list[float], k: int) -> None:
    if k > len(costs):
        with pytest.raises(ValueError, match=f"{len(costs)} parts into {k}"):
            balanced_split(costs, k)
        return
    counts = balanced_split(costs, k)
    assert len(counts) == k and sum(counts) == len(costs) and min(counts) >= 1

    def worst(bounds: list[int]) -> float:
        return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))

    every = [[0, *cuts, len(costs)] for cuts in itertools.combinations(range(1, len(costs)), k - 1)]
    assert worst([0, *itertools.accumulate(counts)]) <= min(worst(b) for b in every) + 1e-9
