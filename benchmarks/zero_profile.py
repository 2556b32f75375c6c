"""Where ZeRO-2's extra CPU time per step goes: ZeRO-1 and ZeRO-2 side by side under cProfile (process time).

The speed run of zero_bench.py (ZeRO-1 and ZeRO-2 pipelines built in the same 4 processes, PP=2 x DP=2, the GPT
example, stepped in turn) with one profiler per pipeline; each function's own time is charged to an area by the
file it lives in (a builtin or a standard-library helper is charged to its callers' areas), and the table gives
CPU ms per step on rank 0 by area, for both stages and their difference.
cProfile slows Python-heavy code more than kernels: the figures show where the difference is, not its size
(zero_bench.py's speed table gives that).

Usage: python benchmarks/zero_profile.py [--steps N] [--d-model D]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks import zero_bench as zb  # noqa: E402
from duplexpipe.parallel import ZeroOptions  # noqa: E402

AREAS = (
    ("FSDP2 hooks and bookkeeping", ("torch/distributed/fsdp/",)),
    ("DTensor", ("torch/distributed/tensor/",)),
    ("dynamo-disable wrappers (FSDP2's)", ("torch/_dynamo/",)),
    ("profiler record_function (FSDP2's)", ("torch/autograd/profiler", "_record_function", "torch/_ops.py")),
    ("optimizer", ("torch/optim/",)),
    ("autograd engine (backward kernels, hooks)", ("run_backward",)),
    ("nn.Module calls (hook dispatch)", ("torch/nn/modules/module.py",)),
    ("the model (GPT forward)", ("duplexpipe/launch/tasks/", "torch/nn/functional.py", "torch/nn/modules/")),
    ("duplexpipe", ("duplexpipe/",)),
)
"""(area, substrings of a profiled function's file or name that put it there); the rest is 'other'."""


def area_of(filename: str, name: str) -> str:
    """The area a profiled function belongs to (first match in AREAS)."""
    where = f"{filename}:{name}"
    return next((area for area, keys in AREAS if any(k in where for k in keys)), "other (kernels, Python)")


def _worker(rank: int, world: int, job: tuple[int, int]) -> dict[int, dict[str, float]]:
    steps, d_model = job
    cfg = zb.ZeroBenchConfig(task_options={"n_layer": 4, "d_model": d_model})
    pipes = {stage: zb._pipeline(cfg, 2, 2, stage, ZeroOptions()) for stage in (1, 2)}
    profiles = {stage: cProfile.Profile(time.process_time) for stage in pipes}
    for step in range(5 + steps):
        for stage, (pipe, task) in pipes.items():
            if step >= 5:
                profiles[stage].enable()
            zb._step(pipe, task, step, cfg.batch_size)
            profiles[stage].disable()
    return {stage: charged(pstats.Stats(prof).stats, steps) for stage, prof in profiles.items()}  # type: ignore


def charged(stats: dict[Any, Any], steps: int) -> dict[str, float]:
    """CPU ms per step by area: each function's own time goes to its area; a function of no area (a builtin
    such as a tensor method, a helper of the standard library) is charged to its callers' areas, split as
    cProfile timed it under each caller."""
    areas: Counter[str] = Counter()
    for (filename, _, name), (_, _, own, _, callers) in stats.items():
        area = area_of(filename, name)
        if area.startswith("other") and callers:
            under = sum(c[2] for c in callers.values()) or 1.0
            for (cfile, _, cname), c in callers.items():
                areas[area_of(cfile, cname)] += 1e3 * own * (c[2] / under) / steps
        else:
            areas[area] += 1e3 * own / steps
    return dict(areas)


def table(areas: dict[int, dict[str, float]]) -> str:
    """Markdown: CPU ms per step by area for ZeRO-1 and ZeRO-2, largest difference first."""
    names = sorted(set(areas[1]) | set(areas[2]), key=lambda a: areas[1].get(a, 0.0) - areas[2].get(a, 0.0))
    out = ["| area | ZeRO-1 ms/step | ZeRO-2 ms/step | difference |", "|---|---|---|---|"]
    for a in [*names, "total"]:
        one, two = ((sum(areas[s].values()) if a == "total" else areas[s].get(a, 0.0)) for s in (1, 2))
        out.append(f"| {a} | {one:.1f} | {two:.1f} | {two - one:+.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Profile, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--d-model", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ranks = harness.spawn(_worker, (args.steps, args.d_model), world=4, timeout_s=1800)
    print(table(ranks[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
