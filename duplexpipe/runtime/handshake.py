"""Start-up handshake: every rank checks that all ranks run the same schedule."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist

from duplexpipe.errors import HandshakeError
from duplexpipe.runtime.backend import is_nccl
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.ir import Schedule

SUMMARY_BYTES = 1024
"""Fixed size of one rank's encoded summary (all_gather needs equal sizes)."""
COMPARED = ("name", "num_ranks", "num_microbatches", "stages", "fingerprint", "codecs")
"""The summary fields that must be equal on every rank."""


def group_store(group: Any) -> Any:
    """The c10d store behind `group` (a PrefixStore for subgroups), or None when unavailable."""
    from torch.distributed import distributed_c10d as c10d

    try:
        return c10d._get_process_group_store(group if group is not None else c10d._get_default_group())
    except Exception:  # noqa: BLE001 - private API; fall back to the default store
        try:
            return c10d._get_default_store()
        except Exception:  # noqa: BLE001
            return None


def _stage_table(schedule: Schedule) -> str:
    text = " ".join(f"{i}@{s.rank}/{s.group}" for i, s in enumerate(schedule.stages))
    if len(text) > 200:
        text = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return text


def summarize(schedule: Schedule, rank: int, local_stages: Collection[int],
              local_error: str = "", codecs: str = "identity/identity",
              fingerprint: str | None = None) -> dict[str, Any]:
    """This rank's view: the schedule's identity, its codecs (activation/gradient names), a fresh
    nonce and any local setup error."""
    expected = sorted(schedule.stages_of_rank(rank)) if rank < schedule.num_ranks else []
    error = local_error
    if not error and sorted(local_stages) != expected:
        error = (f"rank {rank}: modules were given for stages {sorted(local_stages)} but schedule "
                 f"{schedule.name!r} places stages {expected} on rank {rank}")
    return {
        "name": schedule.name[:64],
        "num_ranks": schedule.num_ranks,
        "num_microbatches": schedule.num_microbatches,
        "stages": _stage_table(schedule),
        "fingerprint": fingerprint if fingerprint is not None else schedule.fingerprint(),
        "codecs": codecs[:128],
        "nonce": os.urandom(8).hex(),
        "error": error[:400],
    }


def encode(summary: dict[str, Any]) -> torch.Tensor:
    """A summary as a fixed-size uint8 tensor (zero padded)."""
    blob = json.dumps(summary, sort_keys=True).encode()
    if len(blob) > SUMMARY_BYTES:
        raise ValueError(f"handshake summary is {len(blob)} bytes, more than {SUMMARY_BYTES}")
    out = torch.zeros(SUMMARY_BYTES, dtype=torch.uint8)
    out[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return out


def decode(tensor: torch.Tensor) -> dict[str, Any]:
    """Inverse of `encode`."""
    raw = bytes(tensor.cpu().tolist()).rstrip(b"\0")
    result: dict[str, Any] = json.loads(raw.decode())
    return result


def compare(summaries: list[dict[str, Any]], group_size: int) -> None:
    """Raise HandshakeError unless every rank reported the same schedule and no local error."""
    problems = [s["error"] for s in summaries if s["error"]]
    for key in COMPARED:
        values = [s[key] for s in summaries]
        if any(v != values[0] for v in values):
            listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            problems.append(f"ranks disagree on the schedule's {key} ({listed})")
    if not problems and summaries[0]["num_ranks"] != group_size:
        problems.append(f"schedule {summaries[0]['name']!r} is for {summaries[0]['num_ranks']} ranks "
                        f"but the process group has {group_size}")
    if problems:
        raise HandshakeError("pipeline start-up handshake failed: " + "; ".join(problems))


def handshake(schedule: Schedule, local_stages: Collection[int], group: Any, device: torch.device,
              timeout_s: float, local_error: str = "", codecs: str = "identity/identity",
              fingerprint: str | None = None) -> str:
    """Exchange summaries with every rank of `group`, compare them, return the shared nonce.

    Raises HandshakeError on every rank when any rank runs a different schedule (name, rank
    count, microbatches, stage table or fingerprint), uses other codecs or holds the wrong
    stages; raises PipelineTimeoutError when some rank does not join within `timeout_s`.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    mine = encode(summarize(schedule, rank, local_stages, local_error, codecs, fingerprint)).to(device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    waiter = Watchdog(None, "", rank, timeout_s, timeout_s, gloo=not is_nccl(group))
    waiter.wait_collective(work, "the start-up handshake (every rank of the group must construct "
                     "PipelineRuntime with the same schedule)", "all ranks of the group")
    summaries = [decode(t) for t in gathered]
    compare(summaries, size)
    return str(summaries[0]["nonce"])


def shared_nonce(group: Any, device: torch.device, timeout_s: float, what: str) -> str:
    """A random nonce equal on every rank of `group` (rank 0's), agreed with one bounded all_gather."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.frombuffer(bytearray(os.urandom(8)), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    waiter = Watchdog(None, "", rank, timeout_s, timeout_s, gloo=not is_nccl(group))
    waiter.wait_collective(work, what, "all ranks of the group")
    return bytes(gathered[0].cpu().tolist()).hex()
