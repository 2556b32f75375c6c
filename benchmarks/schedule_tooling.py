"""Times duplexpipe's schedule passes (build, lower, verify, simulate) and torch's plan construction."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from duplexpipe.schedules import registry  # noqa: E402
from duplexpipe.schedules.lower import lower  # noqa: E402
from duplexpipe.schedules.simulate import CostModel, simulate  # noqa: E402
from duplexpipe.schedules.verify import verify  # noqa: E402


@dataclass(frozen=True)
class Grid:
    """What one run measures."""

    headline: tuple[str, int, int]
    """(schedule, P, M) timed first; the full grid's is the case docs/design.md budgets under 1 s."""
    torch: tuple[tuple[str, str, int, int], ...]
    """(our name, torch's name, P, M) for the side-by-side plan construction."""
    schedules: tuple[str, ...]
    """Schedules of the scaling table."""
    ranks: tuple[int, ...]
    """P values of the scaling table."""
    microbatches: tuple[int, ...]
    """M values of the scaling table."""


FULL = Grid(("dualpipe", 64, 512), (("dualpipev", "DualPipeV", 16, 256), ("dualpipev", "DualPipeV", 8, 64)),
            ("1f1b", "zbv", "dualpipe", "dualpipev"), (8, 16, 32, 64, 128), (256, 1024))
QUICK = Grid(("dualpipe", 8, 64), (("dualpipev", "DualPipeV", 4, 16),), ("1f1b", "dualpipe"), (4, 8), (16, 64))


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def time_passes(name: str, ranks: int, microbatches: int, repeats: int) -> dict[str, Any]:
    """Median seconds of each pass over `repeats` runs, on the lowered schedule as the next pass's input."""
    samples: dict[str, list[float]] = {"build_s": [], "lower_s": [], "verify_s": [], "simulate_s": [],
                                       "total_s": []}
    size = 0
    for _ in range(repeats):
        schedule, t_build = _timed(partial(registry.build, name, ranks, microbatches))
        lowered, t_lower = _timed(partial(lower, schedule))
        _, t_verify = _timed(partial(verify, lowered))
        _, t_sim = _timed(partial(simulate, lowered, CostModel(fb=3.0)))
        times = (t_build, t_lower, t_verify, t_sim, t_build + t_lower + t_verify + t_sim)
        for key, value in zip(samples, times, strict=True):
            samples[key].append(value)
        size = sum(len(row) for row in lowered.actions)
    row: dict[str, Any] = {"schedule": name, "P": ranks, "M": microbatches, "actions": size,
                           "repeats": repeats}
    row.update({key: statistics.median(values) for key, values in samples.items()})
    return row


def time_torch(ours: str, theirs: str, ranks: int, microbatches: int, repeats: int) -> dict[str, Any]:
    """Ours (build + lower) against torch's get_schedule_ops(..., with_comms=True), medians."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    mine = [_timed(lambda: lower(registry.build(ours, ranks, microbatches)))[1] for _ in range(repeats)]
    torch_s = [_timed(lambda: get_schedule_ops(theirs, ranks, microbatches, with_comms=True))[1]
               for _ in range(repeats)]
    ours_s, torch_med = statistics.median(mine), statistics.median(torch_s)
    return {"schedule": ours, "torch_schedule": theirs, "P": ranks, "M": microbatches, "repeats": repeats,
            "ours_build_lower_s": ours_s, "torch_get_schedule_ops_s": torch_med,
            "speedup": torch_med / ours_s if ours_s > 0 else None}


BIG = 64 * 1024
"""Cases with P * M at least this many stage-microbatches run once (each takes seconds)."""


def scaling(schedules: Sequence[str], ranks: Sequence[int], microbatches: Sequence[int],
            repeats: int) -> list[dict[str, Any]]:
    """time_passes over the grid, skipping (schedule, P, M) a generator rejects."""
    rows = []
    for name in schedules:
        for p in ranks:
            for m in microbatches:
                if registry.check(name, p, m) is None:
                    rows.append(time_passes(name, p, m, 1 if p * m >= BIG else repeats))
    return rows


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The scaling rows as fixed-width text."""
    head = f"{'schedule':<10} {'P':>4} {'M':>5} {'actions':>8} {'build':>7} {'lower':>7} {'verify':>7} " \
           f"{'simulate':>8} {'total ms':>9} {'runs':>4}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['schedule']:<10} {r['P']:>4} {r['M']:>5} {r['actions']:>8} {_ms(r['build_s']):>7} "
                     f"{_ms(r['lower_s']):>7} {_ms(r['verify_s']):>7} {_ms(r['simulate_s']):>8} "
                     f"{_ms(r['total_s']):>9} {r['repeats']:>4}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; medians are reported")
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds), for smoke runs")
    parser.add_argument("--no-torch", action="store_true", help="skip timing torch's plan construction")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    quick = args.quick
    grid = QUICK if quick else FULL
    repeats = 1 if quick else args.repeats
    name, p, m = grid.headline
    headline = time_passes(name, p, m, repeats if quick else max(repeats, 5))
    verdict = "" if quick else f" ({'under' if headline['total_s'] < 1.0 else 'OVER'} the 1 s budget)"
    print(f"{name} P={p} M={m} ({headline['actions']} actions lowered): build+lower+verify+simulate "
          f"{_ms(headline['total_s'])} ms median{verdict}\n")
    vs_torch = [] if args.no_torch else [time_torch(*case, repeats) for case in grid.torch]
    for r in vs_torch:
        print(f"{r['schedule']} P={r['P']} M={r['M']}: ours build+lower {_ms(r['ours_build_lower_s'])} ms, "
              f"torch get_schedule_ops({r['torch_schedule']!r}, with_comms=True) "
              f"{_ms(r['torch_get_schedule_ops_s'])} ms ({r['speedup']:.1f}x)")
    rows = scaling(grid.schedules, grid.ranks, grid.microbatches, repeats)
    print("\n" + table(rows))
    if args.json:
        result = {"machine": {"python": platform.python_version(), "platform": platform.platform(),
                              "cpus": os.cpu_count()},
                  "headline": headline, "vs_torch": vs_torch, "rows": rows}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
