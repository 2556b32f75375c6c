"""Part 4: schedule tooling scaling (benchmarks/schedule_tooling.py) and torch's plan construction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Sequence

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schedule_tooling.py")

EXTRA_TORCH_CASES: tuple[tuple[str, str, int, int], ...] = (
    ("zbv", "ZBVZeroBubble", 16, 256),
    ("interleaved-1f1b", "Interleaved1F1B", 16, 256),
)
"""(our name, torch's name, P, M) timed here on top of schedule_tooling.py's own DualPipeV cases."""


def run_script(args: Sequence[str], timeout_s: float = 900.0) -> dict[str, Any]:
    """Run schedule_tooling.py --json in a fresh interpreter and return what it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tooling.json")
        proc = subprocess.run([sys.executable, SCRIPT, "--json", path, *args], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{SCRIPT} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        with open(path, encoding="utf-8") as fh:
            data: dict[str, Any] = json.load(fh)
    return data


def extra_torch(cases: Sequence[tuple[str, str, int, int]], repeats: int) -> list[dict[str, Any]]:
    """Ours (build + lower) against torch's plan construction for more schedules, via schedule_tooling."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import schedule_tooling  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    return [schedule_tooling.time_torch(ours, theirs, p, m, repeats) for ours, theirs, p, m in cases]


def run(quick: bool, repeats: int = 1) -> dict[str, Any]:
    """Headline case, scaling grid and torch comparison; `quick` uses the script's small grid."""
    data = run_script(["--quick"] if quick else ["--repeats", str(repeats)])
    if not quick:
        data["vs_torch"] = list(data.get("vs_torch", [])) + extra_torch(EXTRA_TORCH_CASES, max(repeats, 1))
    return {"headline": data["headline"], "rows": data["rows"], "vs_torch": data.get("vs_torch", [])}
