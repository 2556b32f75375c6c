"""Which rank's error is the root cause of a failed run, and how the ranks report it under torchrun.

Locally, `launch` collects every rank's error and names the cause (processes.py). Under torchrun every rank
exits on its own, and torchrun lists each rank that exits non-zero with a block of its own in its summary, so
one bad value used to show a traceback per rank. Here the ranks settle it through torchrun's store: the rank
whose own error it is (the lowest, when several ranks raise the same error) reports it (one log line, and
torchrun's error file with the traceback, so torchrun's summary names it as the root cause) and exits last;
every other rank logs one line naming that rank and exits quietly, with code 0 on the reporter's node, so
torchrun lists the root cause alone, and 1 on other nodes (their agents must fail too).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from duplexpipe.launch.attempts import attempt_prefix

GRACE_S = 10.0
"""After a rank fails, how long to wait for the rank it blames (or any rank) to report its own error, and how
long the reporting rank waits for the others to leave."""
_BLAME = re.compile(r"\brank (\d+) (?:rejected|failed)\b")
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "remote process exited or there was a network error")
"""What gloo's and NCCL's errors say when another rank's process is gone."""
_POLL_S = 0.05
log = logging.getLogger("duplexpipe.launch")


@dataclass(frozen=True)
class Failure:
    """One rank's error as its process reported it."""

    details: str
    """The formatted traceback."""
    blamed: int | None
    """The rank this error says failed first (it stopped because of that rank), None for its own error."""
    summary: str = ""
    """The error in one line: its type and the first line of its message."""


def lost_a_peer(failure: Failure) -> bool:
    """True when `failure` is a closed connection to another rank: a consequence of that rank's death, which a
    launcher may see only after the error (the dead rank's exit status comes later than the reset connection)."""
    return failure.blamed is None and any(text in failure.details for text in _LOST_PEER)


def error_summary(exc: BaseException) -> str:
    """`exc` in one line: "ValueError: first line of the message" (notes added to it left out)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def blamed_rank(exc: BaseException, own_rank: int) -> int | None:
    """The rank that `exc` says failed first, or None when `exc` is this rank's own error.

    A PeerFailedError-style exception carries `failed_rank`; the runtime's other consequences say
    "rank N rejected ..." or "... because rank N failed". The cause chain is searched too.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        failed = getattr(current, "failed_rank", None)
        if isinstance(failed, int) and failed >= 0 and failed != own_rank:
            return failed
        for match in _BLAME.finditer(str(current)):
            if int(match.group(1)) != own_rank:
                return int(match.group(1))
        current = current.__cause__ or current.__context__
    return None


@dataclass(frozen=True)
class Settled:
    """How a failed rank ends under torchrun (record_failure's answer)."""

    cause: int | None
    """The rank that reports the error this rank stopped for; None: this rank reports its own error."""
    same_node: bool = True
    """Whether that rank runs on this node."""


def _failure_store(timeout_s: float) -> Any:
    """A client of the job's rendezvous store (MASTER_ADDR:MASTER_PORT) keyed under this attempt's
    duplexpipe/attempt<n>/failures/ (a restarted attempt never reads a dead attempt's reports)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(attempt_prefix("failures"), store)


def _get(store: Any, key: str) -> dict[str, Any] | None:
    return json.loads(store.get(key).decode()) if store.check([key]) else None


def _same_error_below(store: Any, rank: int, summary: str, deadline: float) -> int | None:
    """The lowest rank below `rank` that failed with the same error, once every lower rank has reported an
    error or said how it ended (or the deadline passed)."""
    waiting = set(range(rank))
    while waiting and time.monotonic() < deadline:
        waiting = {r for r in waiting if not store.check([f"error/{r}"]) and not store.check([f"role/{r}"])}
        if waiting:
            time.sleep(_POLL_S)
    for r in range(rank):
        seen = _get(store, f"error/{r}")
        if seen is not None and seen["summary"] == summary:
            return r
    return None


def _exited(pid: int) -> bool:
    """True once process `pid` of this machine has exited (gone, or a zombie not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return not Path("/proc").is_dir() or not Path(f"/proc/{pid}").exists()
    return state in ("Z", "X")


def _wait_for_the_others(store: Any, rank: int, world: int, node: str, deadline: float) -> None:
    """Until the deadline: every other rank has said how it ends, and those leaving on this node have exited
    (so torchrun does not stop them, and list them, when this rank exits)."""
    waiting = set(range(world)) - {rank}
    while waiting and time.monotonic() < deadline:
        for r in sorted(waiting):
            role = _get(store, f"role/{r}")
            if role is not None and (role["kind"] != "left" or role["node"] != node or _exited(role["pid"])):
                waiting.discard(r)
        if waiting:
            time.sleep(_POLL_S)


_REPORTED = "duplexpipe_reported"


def reported(exc: BaseException) -> bool:
    """True when record_failure made this rank report `exc` (logged, and in torchrun's error file)."""
    return bool(getattr(exc, _REPORTED, False))


def record_failure(exc: BaseException, rank: int, world: int | None = None, grace_s: float = GRACE_S,
                   with_traceback: bool = True) -> Settled:
    """Under torchrun, after `exc` stopped this rank: settle with the other ranks who reports it (see the
    module doc) and return how this rank ends (`with_traceback`: the error file holds the traceback, else the
    one line, e.g. for a configuration error). Best effort: never raises (without the store, a rank reports
    what it knows itself)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    node = os.environ.get("GROUP_RANK", "0")
    summary = error_summary(exc)
    blamed = blamed_rank(exc, rank)
    deadline = time.monotonic() + grace_s
    cause: dict[str, Any] | None = None
    try:
        store = _failure_store(min(grace_s, 5.0))
        if blamed is None:
            store.set(f"error/{rank}", json.dumps({"summary": summary, "node": node, "time": time.time()}))
            blamed = _same_error_below(store, rank, summary, deadline)
        if blamed is None:
            store.set(f"role/{rank}", json.dumps({"kind": "reports", "node": node, "pid": os.getpid()}))
        else:
            store.wait([f"error/{blamed}"], datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
            cause = _get(store, f"error/{blamed}")
    except Exception:  # noqa: BLE001 - the store or the peer is gone: record what we know
        store = None
    if blamed is None:
        _report(exc, rank, summary, with_traceback)
        if store is not None:
            _wait_for_the_others(store, rank, world, node, deadline)
        return Settled(None)
    same_node = cause is not None and cause["node"] == node
    same = cause is not None and cause["summary"] == summary
    line = (f"rank {rank} failed the same way as rank {blamed}: see rank {blamed}'s error" if same else
            f"rank {rank} stopped because rank {blamed} failed: see rank {blamed}'s error")
    log.error("%s", line)
    if hasattr(exc, "add_note"):
        exc.add_note(f"root cause: rank {blamed}'s error (rank {rank} only stopped because of it)")
    if not same_node:  # this node's agent lists the rank: it shows the line, after the cause's stamp
        stamp = max(time.time(), (cause["time"] + 1) if cause is not None else 0)
        _write_error_file(exc, line, "", stamp)
    try:
        if store is not None:
            store.set(f"role/{rank}", json.dumps({"kind": "left", "node": node, "pid": os.getpid()}))
    except Exception:  # noqa: BLE001 - best effort
        pass
    return Settled(blamed, same_node)


def _report(exc: BaseException, rank: int, summary: str, with_traceback: bool) -> None:
    """The reporting rank: one log line, and torchrun's error file with the traceback (its summary's root
    cause)."""
    log.error("rank %d failed: %s", rank, summary)
    _write_error_file(exc, summary, "".join(traceback.format_exception(exc)) if with_traceback else "",
                      time.time())
    try:
        setattr(exc, _REPORTED, True)
    except AttributeError:  # an exception type with __slots__: the caller then reports it again
        pass


def _write_error_file(exc: BaseException, message: str, callstack: str, stamp: float) -> None:
    """torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE), when it set one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": callstack or message, "timestamp": str(int(stamp))}}}
    try:
        with open(path, "w", encoding="utf-8") as fp:
            json.dump(data, fp)
    except OSError as err:
        log.warning("could not write torchrun's error file %s: %s", path, err)
