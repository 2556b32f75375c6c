"""torchrun's restart attempts: which attempt this is, and the store prefix that keeps an attempt to its own keys."""

from __future__ import annotations

import os

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of restarts of the worker group (0 on the first attempt)."""
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""Set to "True" by torchrun when its agent hosts the store at MASTER_ADDR:MASTER_PORT for every attempt."""


def restart_attempt() -> int:
    """Which attempt of a torchrun job this is (TORCHELASTIC_RESTART_COUNT; 0 on the first and outside torchrun)."""
    text = os.environ.get(RESTART_ENV, "0").strip() or "0"
    if not text.isdigit():
        raise ValueError(f"${RESTART_ENV} must be a count, got {text!r}")
    return int(text)


def attempt_prefix(what: str) -> str:
    """The store keys of `what` ("pg", "failures", ...) for this attempt: a restarted attempt never reads a dead
    attempt's keys."""
    return f"duplexpipe/attempt{restart_attempt()}/{what}/"
