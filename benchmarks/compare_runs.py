"""Before/after table of vs_torch over several runs (`python -m benchmarks.compare_runs --before A --after B`)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

RowKey = tuple[str, str]


def _rows(path: str) -> dict[RowKey, dict[str, Any]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    rows = data["vs_torch"]["rows"] if isinstance(data["vs_torch"], dict) else data["vs_torch"]  # or the old format
    return {(r["workload"], r["schedule"]): r for r in rows}


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, q2, q3


def summarize(paths: Sequence[str]) -> dict[RowKey, dict[str, Any]]:
    """Per (workload, schedule): each run's ratio of medians (ours / torch) and every run's per-step ratios pooled."""
    out: dict[RowKey, dict[str, Any]] = {}
    for path in paths:
        for key, row in _rows(path).items():
            entry = out.setdefault(key, {"ratios": [], "paired": []})
            entry["ratios"].append(row["ratio"])
            samples = row["samples"]
            entry["paired"].extend(a / b for a, b in zip(samples["ours"], samples["torch"], strict=True))
    return out


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "-"
    ratios = entry["ratios"]
    q1, q2, q3 = _quartiles(entry["paired"])
    return (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} runs); "
            f"paired {q2:.2f} ({q1:.2f}-{q3:.2f})")


def table(before: Sequence[str], after: Sequence[str]) -> list[str]:
    """Markdown table lines: one row per (workload, schedule) of the `after` runs."""
    old, new = summarize(before), summarize(after)
    return ["| workload | schedule | before: ours/torch (range; paired median, IQR) | after: ours/torch (range; "
            "paired median, IQR) |", "|---|---|---|---|",
            *(f"| {key[0]} | {key[1]} | {_cell(old.get(key))} | {_cell(new[key])} |" for key in new)]


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", nargs="+", required=True, help="results.json of runs before the change")
    parser.add_argument("--after", nargs="+", required=True, help="results.json of runs after the change")
    args = parser.parse_args(argv)
    try:
        print("\n".join(table(args.before, args.after)))
    except (OSError, KeyError, ValueError) as exc:
        print(f"compare_runs: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
