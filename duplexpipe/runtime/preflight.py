"""Verify before running: every schedule the runtime accepts passes the verifier first, verdicts cached.

The verdict (sound, or the verifier's ScheduleError text with the deadlock cycle) is memoized
per schedule fingerprint in a bounded LRU memo, so constructing runtimes for the same schedule
again (every built-in, every step of a sweep) costs one dictionary lookup.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules.ir import Schedule
from duplexpipe.schedules.verify import verify

VERDICTS_KEPT = 32
"""How many (schedule fingerprint, NCCL rules) verdicts the memo keeps."""


@dataclass(frozen=True)
class _ByFingerprint:
    """A schedule keyed (hashed and compared) by its fingerprint alone."""

    fingerprint: str
    schedule: Schedule = field(compare=False, hash=False)


@functools.lru_cache(maxsize=VERDICTS_KEPT)
def _verdict(key: _ByFingerprint, nccl: bool) -> str:
    try:
        verify(key.schedule, nccl=nccl)
    except ScheduleError as exc:
        return str(exc)
    return ""


def verdict(schedule: Schedule, fingerprint: str, nccl: bool) -> str:
    """'' when `schedule` (with that fingerprint) is complete, matched and deadlock-free (and, with
    `nccl`, posts every rank pair's messages in one order); else the verifier's report."""
    return _verdict(_ByFingerprint(fingerprint, schedule), nccl)


def cache_info() -> functools._CacheInfo:
    """Hits and misses of the verdict memo (for tests and benchmarks)."""
    return _verdict.cache_info()
