"""Tests for duplexpipe.comm.agreement: on 3 gloo ranks, flags raised on one rank seen by all, and texts of different
lengths gathered in rank order, over the world and over a group of two (the third rank takes no part); without a
process group, the rank's own."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from duplexpipe.comm.agreement import any_rank, every_rank_texts

WORLD = 3
CPU = torch.device("cpu")


def _worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["flags"] = any_rank([rank == 1, False, True], None, CPU)
    texts = [f"rank {rank} says {'é' * rank}", "x" * (40 * rank)] if rank else []
    out["texts"] = every_rank_texts(texts, None, CPU)
    pair = dist.new_group([0, 2])
    if rank != 1:
        out["pair flags"] = any_rank([rank == 2], pair, CPU)
        out["pair texts"] = every_rank_texts([str(rank)], pair, CPU)
    return out


def test_a_flag_on_one_rank_is_seen_by_every_rank(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["flags"] == [True, False, True]
    assert [res.get("pair flags") for res in results] == [[True], None, [True]]


def test_every_rank_gets_every_ranks_texts_in_rank_order(results: list[dict[str, Any]]) -> None:
    want = [[], ["rank 1 says é", "x" * 40], ["rank 2 says éé", "x" * 80]]
    for res in results:
        assert res["texts"] == want
    assert [res.get("pair texts") for res in results] == [[["0"], ["2"]], None, [["0"], ["2"]]]


def test_without_a_process_group_a_rank_agrees_with_itself() -> None:
    assert any_rank([True, False], None, CPU) == [True, False]
    assert every_rank_texts(["a", "b"], None, CPU) == [["a", "b"]]
