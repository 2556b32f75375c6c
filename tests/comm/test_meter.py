"""Tests for duplexpipe.comm.meter's ring model (the dispatch cross-check runs in test_comm_reducers)."""

from __future__ import annotations

import pytest

from duplexpipe.comm.meter import KINDS, WireMeter, ring_bytes


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_ring_model(n: int) -> None:
    b = 1 << 20
    assert ring_bytes("all_reduce", b, n) == 2 * (n - 1) * b / n
    for kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert ring_bytes(kind, b, n) == (n - 1) * b / n
    assert ring_bytes("send", b, n) == b and ring_bytes("recv", b, n) == 0
    # an all-reduce moves what a reduce-scatter plus an all-gather of the same tensor move
    assert ring_bytes("all_reduce", b, n) == ring_bytes("reduce_scatter", b, n) + ring_bytes("all_gather", b, n)
    assert set(KINDS) == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv"}


def test_meter_accumulates_by_kind_and_resets() -> None:
    meter = WireMeter()
    meter.record("all_reduce", 400, 2)
    meter.record("all_gather", 80, 4)
    meter.record("all_gather", 80, 4)
    snap = meter.snapshot()
    assert snap == {"total_bytes": 520.0, "bytes": {"all_reduce": 400.0, "all_gather": 120.0},
                    "calls": {"all_reduce": 1, "all_gather": 2}}
    meter.reset()
    assert meter.total_bytes == 0 and meter.snapshot()["calls"] == {}


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ValueError, match="unknown collective kind 'gossip'"):
        ring_bytes("gossip", 1, 2)
    with pytest.raises(ValueError, match="group_size >= 1 and nbytes >= 0, got 0 and 5"):
        ring_bytes("all_reduce", 5, 0)
