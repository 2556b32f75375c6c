"""The one runner and publisher: run parts, print them, merge OUT/results.json, draw figures, update the docs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.framework import Part, Result, with_settings

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("vs_torch", "measured_vs_sim", "overlap", "schedule_tooling", "profile_runtime", "auto_search",
         "p2p_compression", "dp_compression", "plan_vs_measured", "zero_bench", "spawn_bench", "auto_vs_hand",
         "moe_overlap", "compression", "cuda_overlap", "reliability", "vs_torch_tp",
         "plan_tp", "compile", "plan_moe", "checkpointing",
         "zero3_bench", "float8_bench", "data_memory", "adaptive_comm",
         "memory_vs_predicted", "plan_fits_budget")  # every part in report order: its number
         # is its place here


def load(name: str) -> Part[Any]:
    """The part `benchmarks.<name>` defines."""
    if name not in PARTS:
        raise ValueError(f"unknown part {name!r}; choose from {', '.join(PARTS)}")
    part: Part[Any] = importlib.import_module(f"benchmarks.{name}").PART
    return part


def number(name: str) -> int:
    """The part's number in the reports."""
    return PARTS.index(name) + 1


def main(argv: Sequence[str] | None = None, only: str | None = None) -> int:
    """`python -m benchmarks` (every part `make bench` runs, or --parts), or one part (`only`)."""
    given = list(sys.argv[1:] if argv is None else argv)
    fields = "" if only is None else "config fields (--set): " + ", ".join(
        f"{f.name}={getattr(load(only).config, f.name)!r}" for f in dataclasses.fields(load(only).config))
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks{'.' + only if only else ''}", epilog=fields,
                                     description=f"{number(only)}. {load(only).title}" if only else __doc__)
    parser.add_argument("--quick", action="store_true", help="each part's smoke configuration")
    if only is None:
        parser.add_argument("--parts", default="", help=f"comma list out of {','.join(PARTS)} (default: all but "
                            "the parts run only when named)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="change a field of the (one) part's config; repeatable")
    parser.add_argument("--out", default=str(ROOT / "bench-output"), help="results folder (results.json, figures)")
    parser.add_argument("--docs", default=str(ROOT / "docs"), help="docs folder to update, or 'none'")
    parser.add_argument("--load-note", default="", help="how loaded the machine was, for the docs")
    parser.add_argument("--replot", action="store_true", help="measure nothing: publish OUT/results.json again")
    args = parser.parse_args(given)
    try:
        chosen = [only] if only else _chosen(args.parts)
        parts = [load(name) for name in chosen]
        if args.set and len(parts) != 1:
            raise ValueError("--set changes one part's config: name exactly one part")
        configs = [with_settings(p.quick if args.quick else p.config, args.set) for p in parts]
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    path = Path(args.out) / "results.json"
    earlier = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    results = {k: v for k, v in earlier.items() if isinstance(v, dict) and "meta" in v}  # not an older format's
    failed = []
    if not args.replot:
        command = _command(only, given)
        for part, config in zip(parts, configs, strict=True):
            try:
                results[part.name] = measure(part, config, command, args.load_note, args.quick)
            except Exception:  # noqa: BLE001 - one broken part must not lose the others' figures
                failed.append(part.name)
                print(f"[{part.name} FAILED]\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    publish(results, [p.name for p in parts if p.name in results], args.out, args.docs)
    return 1 if failed else 0


def _chosen(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    return names or [name for name in PARTS if load(name).in_bench]


def _command(only: str | None, given: list[str]) -> str:
    """The command line as run, for the docs: the load note (recorded on its own) as NOTE, folders as DIR."""
    shown = list(given)
    for at, arg in enumerate(shown[:-1]):
        if arg == "--load-note":
            shown[at + 1] = "NOTE"
        elif arg in ("--out", "--docs") and shown[at + 1] != "none":
            shown[at + 1] = "DIR"  # a path of the machine it ran on says nothing to a reader
    return shlex.join(["python", "-m", "benchmarks" + (f".{only}" if only else ""), *shown])


def measure(part: Part[Any], config: Any, command: str, load_note: str, quick: bool) -> Result:
    """Run one part; its result with how, when and where it ran under "meta"."""
    before, uptime, started = _load(), harness.uptime(), time.monotonic()
    result = part.run(config)
    wall = time.monotonic() - started
    print(f"[{part.name}: {wall:.0f} s]", file=sys.stderr, flush=True)
    result["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "command": command, "wall_s": wall,
                      "load_before": before, "load_after": _load(), "uptime": uptime, "quick": quick,
                      "load_note": load_note or "No note on other load was given.", "machine": harness.machine_info()}
    return result


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def publish(results: dict[str, Result], chosen: Sequence[str], out: str, docs: str) -> None:
    """Print the chosen parts; draw their figures; unless docs is 'none', rewrite each docs block they write."""
    for name in chosen:
        part = load(name)
        print(f"\n{number(name)}. {part.title}\n{part.text(results[name])}", flush=True)
    if docs == "none":
        for name in chosen:
            load(name).figures(results[name], out)
        return
    for block in sorted({load(name).block_of(results[name]) for name in chosen}):
        shared = sum(load(n).block_of({}) == block for n in PARTS) > 1
        members = [n for n in PARTS if n in results and load(n).block_of(results[n]) == block]
        text = "\n\n".join(_section(load(n), results[n], docs, shared) for n in members)
        update_doc(os.path.join(docs, "benchmarks.md"), text, block)


def _section(part: Part[Any], result: Result, docs: str, heading: bool) -> str:
    """A part's docs section: how it ran, its report, its figures."""
    meta = result.get("meta", {})
    m = meta.get("machine", {})
    lines = [f"### {number(part.name)}. {part.title}"] if heading else []
    lines.append(f"Run on {meta.get('date', '?')}: `{meta.get('command', '?')}` ({meta.get('wall_s', 0):.0f} s "
                 f"wall) on {m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}; load "
                 f"average (1, 5, 15 min) before {meta.get('load_before', '?')}, after "
                 f"{meta.get('load_after', '?')}. {meta.get('load_note', '')}")
    lines.append(part.markdown(result))
    img = os.path.join(docs, "img")
    os.makedirs(img, exist_ok=True)
    lines += [f"![{caption}](img/{name})" for name, caption in part.figures(result, img)]
    return "\n\n".join(lines)


def update_doc(path: str, generated: str, block: str) -> None:
    """Replace the text between `<!-- bench:BLOCK:begin -->` and its end marker (append the block if absent)."""
    begin, end = f"<!-- bench:{block}:begin -->", f"<!-- bench:{block}:end -->"
    text = Path(path).read_text(encoding="utf-8") if os.path.exists(path) else "# Benchmarks\n"
    new = f"{begin}\n{generated.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: new, text) if pattern.search(text) else text.rstrip() + "\n\n" + new + "\n"
    Path(path).write_text(text, encoding="utf-8")
