"""Time and peak memory of the `duplexpipe` command at scale: large P, large plots, views into them.

`python benchmarks/cli_scale.py [--source DIR] [--cases NAME,...] [--json OUT]` runs each case as its own
process and reports wall time, CPU time (user + system) and peak resident memory. `--source` runs another
checkout's package (e.g. an older commit unpacked with `git archive`) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Case:
    """One command line to measure."""

    name: str
    """Short label."""
    argv: tuple[str, ...]
    """Arguments after `duplexpipe`; `{out}` becomes a scratch directory."""


CASES = (
    Case("simulate-1f1b-P2048", ("simulate", "1f1b", "-p", "2048", "-m", "8", "--json")),
    Case("simulate-1f1b-P10000", ("simulate", "1f1b", "-p", "10000", "-m", "8", "--json")),
    Case("plot-dualpipe-P64-M512", ("simulate", "dualpipe", "-p", "64", "-m", "512", "--plot", "{out}/dp.png")),
    Case("plot-dualpipe-P64-M512-view", ("simulate", "dualpipe", "-p", "64", "-m", "512", "--plot", "{out}/v.png",
                                         "--ranks-shown", "0-7,56-63", "--window", "0:200")),
    Case("compare-P64-M512-plot", ("compare", "-p", "64", "-m", "512", "--plot", "{out}/cmp.png")),
)


@dataclass(frozen=True)
class Result:
    """What one case took."""

    name: str
    exit_code: int
    wall_s: float
    cpu_s: float
    peak_rss_mb: float


def measure(case: Case, source: str, out: str, timeout: float) -> Result:
    """Run one case in a fresh process; CPU time and peak RSS come from getrusage of the child."""
    env = dict(os.environ, PYTHONPATH=source, MPLBACKEND="Agg")
    argv = [a.replace("{out}", out) for a in case.argv]
    code = ("import resource, sys; from duplexpipe.cli import main; rc = main(sys.argv[1:]); "
            "u = resource.getrusage(resource.RUSAGE_SELF); "
            "print(f'@@ {u.ru_utime + u.ru_stime} {u.ru_maxrss}', file=sys.stderr); sys.exit(rc)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False, cwd=out)
    wall = time.perf_counter() - start
    stats = [line.split() for line in proc.stderr.splitlines() if line.startswith("@@ ")]
    cpu, rss = (float(stats[-1][1]), float(stats[-1][2])) if stats else (float("nan"), float("nan"))
    return Result(case.name, proc.returncode, wall, cpu, rss / 1024)


def main(argv: list[str] | None = None) -> list[Result]:
    """Measure the chosen cases and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=ROOT, help="directory holding the duplexpipe package to run")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if c.name in args.cases.split(",")]
    results = []
    print(f"source {args.source}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'case':<30} {'exit':>4} {'wall s':>8} {'cpu s':>8} {'peak MB':>8}")
    with tempfile.TemporaryDirectory() as out:
        for case in chosen:
            r = measure(case, os.path.abspath(args.source), out, args.timeout)
            results.append(r)
            print(f"{r.name:<30} {r.exit_code:>4} {r.wall_s:>8.2f} {r.cpu_s:>8.2f} {r.peak_rss_mb:>8.0f}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([r.__dict__ for r in results], fh, indent=1)
    return results


if __name__ == "__main__":
    main()
