"""How long `run(fn, 4)` of a trivial function takes, by start method: the first launch of a fresh interpreter
(forkserver: the server starts and imports torch then) and a second launch in the same interpreter.

Each repetition is a fresh `python -c` (so nothing is cached in the interpreter); it times `run` itself (not
the interpreter's own start or its import of duplexpipe), twice. The methods alternate, so both see the
same machine load; the table gives the median and the range over the repetitions.

Usage: python benchmarks/spawn_bench.py [--reps N] [--ranks N] [--docs DIR]
(`make bench` runs it as the part "spawn"; --docs writes the section between its markers in DIR/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from duplexpipe.launch.processes import START_METHODS  # noqa: E402

PROBE = """
import json, sys, time
t0 = time.perf_counter()
from duplexpipe.launch.processes import run
from benchmarks.spawn_bench import trivial
t1 = time.perf_counter()
run(trivial, {ranks}, start_method={method!r})
t2 = time.perf_counter()
run(trivial, {ranks}, start_method={method!r})
t3 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "first_s": t2 - t1, "second_s": t3 - t2}}))
"""
"""The program each repetition runs (a fresh interpreter)."""


def trivial() -> int:
    """The function the ranks run: nothing."""
    return 0


@dataclass(frozen=True)
class SpawnConfig:
    """What to time."""

    reps: int = 5
    """Fresh interpreters per start method."""
    ranks: int = 4
    """Processes per run()."""
    methods: tuple[str, ...] = START_METHODS
    """Start methods, the default first."""


def probe(method: str, ranks: int) -> dict[str, float]:
    """One fresh interpreter's times (seconds) for `method`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("DUPLEXPIPE_START_METHOD", None)
    out = subprocess.run([sys.executable, "-c", PROBE.format(ranks=ranks, method=method)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {method} probe failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run(cfg: SpawnConfig) -> dict[str, Any]:
    """Every repetition's times per method, the methods alternating, and the load around them."""
    before = [round(x, 2) for x in os.getloadavg()]
    times: dict[str, list[dict[str, float]]] = {m: [] for m in cfg.methods}
    for _ in range(cfg.reps):
        for method in cfg.methods:
            times[method].append(probe(method, cfg.ranks))
    return {"config": asdict(cfg), "times": times, "load_before": before,
            "load_after": [round(x, 2) for x in os.getloadavg()]}


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per method: median, min and max of the first and the second launch."""
    out = []
    for method, reps in result["times"].items():
        row: dict[str, Any] = {"method": method}
        for key in ("first_s", "second_s"):
            values = [r[key] for r in reps]
            row[key] = (statistics.median(values), min(values), max(values))
        out.append(row)
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown: seconds per run() by start method."""
    ranks = result["config"]["ranks"]
    out = [f"| start method | first run(fn, {ranks}) s: median (min-max) | second run(fn, {ranks}) s |",
           "|---|---|---|"]
    for r in rows(result):
        cells = [f"{m:.2f} ({lo:.2f}-{hi:.2f})" for m, lo, hi in (r["first_s"], r["second_s"])]
        default = " (default)" if r["method"] == START_METHODS[0] else ""
        out.append(f"| {r['method']}{default} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)


BEGIN = "<!-- bench:spawn:begin -->"
END = "<!-- bench:spawn:end -->"


def markdown(result: dict[str, Any]) -> str:
    """The docs section."""
    cfg, meta = result["config"], result.get("meta", {})
    return "\n".join([
        f"Run on {meta.get('date', '?')}: `{meta.get('command', '?')}`; load average (1, 5, 15 min) before "
        f"{result['load_before']}, after {result['load_after']}. {cfg['reps']} fresh interpreters per method, "
        "alternating; each times `run(fn, "
        f"{cfg['ranks']})` of a function that returns at once, twice (the interpreter's own start and its "
        "import of duplexpipe not counted).", "", table(result)])


def publish(result: dict[str, Any], docs: str) -> None:
    """The section between BEGIN and END of docs/benchmarks.md."""
    report.update_doc(os.path.join(docs, "benchmarks.md"), markdown(result), BEGIN, END)


def main(argv: list[str] | None = None) -> int:
    """Time, print the table, optionally write JSON and the docs section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=SpawnConfig.reps)
    parser.add_argument("--ranks", type=int, default=SpawnConfig.ranks)
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--docs", default="", help="docs directory: section in DIR/benchmarks.md")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.ranks < 1:
        print(f"spawn_bench.py: --reps and --ranks must be >= 1, got {args.reps} and {args.ranks}", file=sys.stderr)
        return 2
    result = run(SpawnConfig(reps=args.reps, ranks=args.ranks))
    result["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"),
                      "command": "python benchmarks/spawn_bench.py " + " ".join(argv or sys.argv[1:])}
    print(markdown(result))
    report.save_and_publish(result, args.json, args.docs, publish)
    return 0


if __name__ == "__main__":
    sys.exit(main())
