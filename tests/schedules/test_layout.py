"""Layout: the rank pairs that exchange messages, per schedule shape."""

from __future__ import annotations

import pytest

from duplexpipe.schedules.layout import Layout
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build


@pytest.mark.parametrize(("name", "ranks", "pairs"), [
    ("1f1b", 4, [(0, 1), (1, 2), (2, 3)]),
    ("interleaved-1f1b", 4, [(0, 1), (0, 3), (1, 2), (2, 3)]),  # the wrap from rank 3's chunk to rank 0's
    ("dualpipe", 4, [(0, 1), (1, 2), (2, 3)]),  # both directions use the same pairs
    ("zbv", 2, [(0, 1)]),  # the V's turn stays on rank 1
    ("gpipe", 1, []),
])
def test_rank_pairs_are_the_sorted_pairs_of_ranks_that_exchange_messages(name: str, ranks: int,
                                                                         pairs: list[tuple[int, int]]) -> None:
    assert Layout.of(lower(build(name, ranks, 2 * ranks))).rank_pairs() == pairs
