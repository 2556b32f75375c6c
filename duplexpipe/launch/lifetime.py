"""A local job's ranks cannot outlive its launcher: each rank dies with its parent (Linux's parent-death signal) and
when a lifeline pipe only the launcher holds reaches its end (any platform, even after SIGKILL); SIGTERM and SIGHUP to
the launcher stop the ranks before it exits."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any

PR_SET_PDEATHSIG = 1
"""prctl's option that sends this process a signal when its parent ends (Linux)."""


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the launcher, or the fork server that ends with it) ends."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the watchdog alone ends the rank
        pass


def watch_launcher(lifeline: Any) -> None:
    """End this rank once the launcher is gone (on every platform): a thread waits on the lifeline, a pipe whose
    other end only the launcher holds, and exits the process at its end of file."""
    def wait() -> None:
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=wait, name="duplexpipe-launcher-watchdog", daemon=True).start()


FORWARDED_SIGNALS = ("SIGTERM", "SIGHUP")
"""Signals that stop a local job's launcher and, through it, its ranks (what `kill` and a closed terminal send)."""


def _signalled(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    print(f"duplexpipe: stopped by {name}: stopping the ranks", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def stop_on_signals() -> dict[int, Any]:
    """In the main thread: SIGTERM and SIGHUP raise SystemExit(128 + signal), so `launch` stops its ranks before the
    launcher exits; the handlers they replace."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for name in FORWARDED_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) in (signal.SIG_DFL, None):
            previous[int(number)] = signal.signal(number, _signalled)
    return previous


def restore_signals(previous: dict[int, Any]) -> None:
    """Put back the handlers `stop_on_signals` replaced."""
    for number, handler in previous.items():
        signal.signal(number, handler)
