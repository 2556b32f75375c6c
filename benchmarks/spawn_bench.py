"""Part: how long `run(fn, 4)` of a trivial function takes, by start method, first and second launch."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.framework import Block, Part, Result
from benchmarks.internals import START_METHODS
from benchmarks.runner import ROOT, main

PROBE = """
import json, time
t = [time.perf_counter()]
from duplexpipe import run
from benchmarks.spawn_bench import trivial
t.append(time.perf_counter())
for _ in range(2):
    run(trivial, {ranks}, start_method={method!r})
    t.append(time.perf_counter())
print(json.dumps({{"import_s": t[1] - t[0], "first_s": t[2] - t[1], "second_s": t[3] - t[2]}}))
"""
"""The program each repetition runs in a fresh interpreter (so nothing is cached): it times `run` itself, twice."""


def trivial() -> int:
    """The function the ranks run: nothing."""
    return 0


@dataclass(frozen=True)
class SpawnConfig:
    """What to time; the methods alternate, so both see the same machine load."""

    reps: int = 5  # fresh interpreters per start method
    ranks: int = 4  # processes per run()
    methods: tuple[str, ...] = START_METHODS  # start methods, the default first

    def __post_init__(self) -> None:
        if self.reps < 1 or self.ranks < 1:
            raise ValueError(f"reps and ranks must be >= 1, got {self.reps} and {self.ranks}")


def probe(method: str, ranks: int) -> dict[str, float]:
    """One fresh interpreter's times (seconds) for `method`."""
    env = {k: v for k, v in os.environ.items() if k != "DUPLEXPIPE_START_METHOD"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(ranks=ranks, method=method)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {method} probe failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run(cfg: SpawnConfig) -> Result:
    """Every repetition's times per method, the methods alternating."""
    times: dict[str, list[dict[str, float]]] = {m: [] for m in cfg.methods}
    for _ in range(cfg.reps):
        for method in cfg.methods:
            times[method].append(probe(method, cfg.ranks))
    return {"config": asdict(cfg), "times": times}


def rows(result: Result) -> list[dict[str, Any]]:
    """Per method: median, min and max of the first and the second launch."""
    return [{"method": method, **{key: (statistics.median(v := [r[key] for r in reps]), min(v), max(v))
                                  for key in ("first_s", "second_s")}} for method, reps in result["times"].items()]


def report(result: Result) -> list[Block]:
    """Seconds per run() by start method."""
    cfg = result["config"]
    return [f"{cfg['reps']} fresh interpreters per method, alternating; each times `run(fn, {cfg['ranks']})` of a "
            "function that returns at once, twice (the interpreter's own start and its import of duplexpipe not "
            "counted).", [["start method", f"first run(fn, {cfg['ranks']}) s: median (min-max)",
                           f"second run(fn, {cfg['ranks']}) s"]] + [
                [r["method"] + (" (default)" if r["method"] == START_METHODS[0] else ""),
                 *(f"{m:.2f} ({lo:.2f}-{hi:.2f})" for m, lo, hi in (r["first_s"], r["second_s"]))]
                for r in rows(result)]]


PART = Part("spawn_bench", "Starting processes", SpawnConfig(), SpawnConfig(reps=1, ranks=2), run, report,
            block="spawn")

if __name__ == "__main__":
    raise SystemExit(main(only=PART.name))
