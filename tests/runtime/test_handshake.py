"""Start-up handshake: summaries, comparison, and mismatches failing on every rank within seconds."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import loss_fn, make_parts, stage_modules

from duplexpipe.comm.codec import CastCodec
from duplexpipe.errors import HandshakeError, PipelineTimeoutError
from duplexpipe.runtime import PipelineRuntime, RuntimeConfig
from duplexpipe.runtime.handshake import compare, decode, encode, handshake, summarize
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build

QUICK_S = 10.0
"""A mismatch must be reported well before the (60 s) wait timeout used in these cases."""


def test_summary_round_trips_through_a_tensor() -> None:
    schedule = lower(build("dualpipe", 4, 8))
    summary = summarize(schedule, 1, schedule.stages_of_rank(1))
    assert decode(encode(summary)) == summary
    assert summary["fingerprint"] == schedule.fingerprint()
    assert summary["error"] == "" and summary["codecs"] == "identity/identity"


def test_summary_reports_wrong_local_stages() -> None:
    schedule = lower(build("1f1b", 2, 4))
    summary = summarize(schedule, 1, [0])
    assert "rank 1: modules were given for stages [0]" in summary["error"]
    assert "places stages [1] on rank 1" in summary["error"]


def test_compare_names_each_differing_field_with_every_rank_value() -> None:
    a = lower(build("1f1b", 2, 4))
    b = lower(build("1f1b", 2, 6))
    summaries = [summarize(a, 0, [0]), summarize(b, 1, [1])]
    with pytest.raises(HandshakeError) as info:
        compare(summaries, 2)
    text = str(info.value)
    assert "num_microbatches (rank 0: 4, rank 1: 6)" in text
    assert "fingerprint" in text
    compare([summarize(a, 0, [0]), summarize(a, 1, [1])], 2)  # equal views pass


def test_compare_rejects_a_group_of_the_wrong_size() -> None:
    schedule = lower(build("1f1b", 4, 4))
    with pytest.raises(HandshakeError, match="is for 4 ranks but the process group has 2"):
        compare([summarize(schedule, r, [r]) for r in range(2)], 2)


def _attempt(make: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        value = make()
        return {"ok": True, "value": value, "seconds": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"ok": False, "type": type(exc).__name__, "text": str(exc),
                "seconds": time.monotonic() - start}


def _runtime(name: str, P: int, M: int, rank: int, group: Any, stages: list[int] | None = None,
             timeout_s: float = 60.0, codec: Any = None) -> PipelineRuntime:
    schedule = lower(build(name, P, M))
    parts = make_parts(schedule.num_groups)
    modules = stage_modules(schedule, rank, parts)
    if stages is not None:
        modules = {s: parts[schedule.stages[s].group] for s in stages}
    return PipelineRuntime(schedule, modules, loss_fn, group=group,
                           config=RuntimeConfig(timeout_s=timeout_s, gradient_codec=codec))


def _worker(rank: int, world: int) -> dict[str, Any]:
    groups = [dist.new_group([0, 1]) for _ in range(6)]
    out = {
        "same": _attempt(lambda: handshake(lower(build("zbv", 2, 4)), [rank, 3 - rank], groups[0],
                                           torch.device("cpu"), 30.0)),
        "microbatches": _attempt(lambda: _runtime("1f1b", 2, 4 if rank == 0 else 6, rank, groups[1])),
        "name": _attempt(lambda: _runtime("gpipe" if rank == 0 else "1f1b", 2, 4, rank, groups[2])),
        "stages": _attempt(lambda: _runtime("1f1b", 2, 4, rank, groups[3],
                                            stages=[0] if rank == 1 else None)),
        "codecs": _attempt(lambda: _runtime("1f1b", 2, 4, rank, groups[5],
                                            codec=CastCodec(torch.bfloat16) if rank == 1 else None)),
    }
    if rank == 0:  # rank 1 never joins: rank 0 must time out naming the handshake
        out["absent"] = _attempt(lambda: _runtime("1f1b", 2, 4, rank, groups[4], timeout_s=1.0))
    else:
        time.sleep(3.0)  # stay alive (an exited peer is a different error)
    return out


def test_same_schedule_agrees_on_one_nonce(results: Any) -> None:
    assert all(r["same"]["ok"] for r in results), results
    assert results[0]["same"]["value"] == results[1]["same"]["value"]


@pytest.mark.parametrize("case, needle", [
    ("microbatches", "num_microbatches (rank 0: 4, rank 1: 6)"),
    ("name", "name (rank 0: 'gpipe', rank 1: '1f1b')"),
    ("stages", "rank 1: modules were given for stages [0]"),
    ("codecs", "codecs (rank 0: 'identity/identity', rank 1: 'identity/cast-bfloat16')"),
])
def test_mismatch_fails_on_every_rank_within_seconds(results: Any, case: str, needle: str) -> None:
    for rank, rec in enumerate(results):
        got = rec[case]
        assert not got["ok"] and got["type"] == HandshakeError.__name__, (rank, got)
        assert needle in got["text"], (rank, got["text"])
        assert got["seconds"] < QUICK_S, (rank, got["seconds"])


def test_missing_rank_times_out_naming_the_handshake(results: Any) -> None:
    got = results[0]["absent"]
    assert not got["ok"] and got["type"] == PipelineTimeoutError.__name__, got
    assert "rank 0: timed out after 1 s waiting for the start-up handshake" in got["text"]
    assert "peer: all ranks of the group" in got["text"]
    assert got["seconds"] < QUICK_S
