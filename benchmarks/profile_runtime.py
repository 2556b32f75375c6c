"""Part: where a rank's step time goes on each side of the A/B run (py-spy), and what-if runs of runtime variants."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

from benchmarks import harness, models, runner
from benchmarks.framework import Block, Part, Result, ms
from benchmarks.models import build_ours, build_pipeline, build_torch_pipe, num_stages
from duplexpipe.train.pipeline_config import SafetyConfig

TP_BUCKETS = (("TP collectives (functional collectives, their waits)", ("_functional_collectives.py",)),
              ("DTensor dispatch (sharding propagation, layouts)", ("tensor/_dispatch.py", "_sharding_prop.py",
                                                                    "tensor/_redistribute.py")))
"""Under tensor parallelism, on both sides: DTensor's collectives, and its per-operation work."""
BUCKETS: Mapping[str, tuple[tuple[str, tuple[str, ...]], ...]] = MappingProxyType({
    "ours": (
        ("wait for a receive (MailTransport.take)", ("MailTransport.take (",)),
        ("step-start agreement (star of messages)", ("agree (",)),
        ("loss sum (SharedSum / PendingSum)", ("PendingSum.value (", "SharedSum.value (")),
        ("DualPipe mirrored-gradient exchange", ("MirrorSum.",)),
        ("end-of-step send completion", ("MailTransport.finish (",)),
        ("post receives (irecv)", ("MailTransport.expect (",)),
        ("post sends (ProcessGroup.send)", ("MailTransport.send (",)),
        ("reap completed sends (NCCL only)", ("MailTransport.reap (",)),
        ("I: autograd-graph analysis (runtime.backward.graph)", ("_parents (", "_ancestors (", "_param_groups (",
                                                                 "_intermediates (")),
        *TP_BUCKETS,
        ("forward compute (module + loss)", ("Dispatcher.run_forward (",)),
        ("backward compute (B, I, W)", ("Dispatcher.run_backward (", "Dispatcher.weight (")),
        ("trainer: optimizer step, norm, zero_grad", ("Pipeline._apply (", "zero_grad (")),
    ),
    "torch": (
        ("wait for P2P (_wait_batch_p2p)", ("_wait_batch_p2p (",)), ("post P2P (batch_isend_irecv)", ("_batch_p2p (",)),
        ("I: autograd-graph analysis (_backward.py)", ("get_param_groups (", "reverse_closure (",
                                                      "construct_reverse_graph (")),
        *TP_BUCKETS,
        ("forward compute (module + loss)", ("forward_one_chunk (", "_maybe_compute_loss (")),
        ("backward compute (B, I, W)", ("backward_one_chunk (", "backward_weight_one_chunk (")),
        ("gradient scaling", ("perform_reduce_grad (", "scale_grads (")),
        ("optimizer step, zero_grad", ("Optimizer.step (", "SGD.step (", "zero_grad (")),
    ),
})  # per side, (label, frame texts): a sample goes to the first bucket with a frame text in its stack
STEP_FRAMES = ("Pipe.step (", "Pipeline.step (")  # a sample counts when one of these (a timed step) is in its stack
WHATIF_VARIANTS = ("as shipped (inputs agreed every step)", "check_inputs_every_step=False")
"""Runtime configurations timed step by step, in rotating order, in the same processes."""


@dataclass(frozen=True)
class ProfileConfig:
    """What to profile and time."""

    cases: tuple[tuple[str, str, int], ...] = (("1f1b", "mlp", 60), ("zbv", "transformer", 10))
    """(schedule, workload, steps) profiled under py-spy on both sides; workload "mlp", "transformer", "sleep", or
    "gpt-tp" / "gpt-tp-sp" (vs_torch_tp's GPT at PP=2 x TP=2, without / with sequence parallelism; world 4)."""
    whatif: tuple[tuple[str, str, int], ...] = (("1f1b", "mlp", 20), ("1f1b", "sleep", 4))  # the what-if runs, alike
    lookahead: tuple[int, ...] = ()  # recv_lookahead depths to compare with torch on the first case; then no profile
    fixed_shapes: bool = False  # ours: SafetyConfig.check_inputs_every_step=False
    cpu: bool = False  # on-CPU samples only (waits drop out: CPU time per step and rank)
    top: int = 0  # also report this many top functions by inclusive and by self time
    rate: int = 250  # py-spy samples per second
    world: int = 4  # pipeline ranks (gloo processes)


QUICK = ProfileConfig((("1f1b", "mlp", 2),), (("1f1b", "sleep", 2),), world=2)


def spec_of(workload: str) -> models.ModelSpec:
    """The model of a workload name."""
    sleep = models.ModelSpec("sleep", width=64, batch=16, sleep_ms=(20.0, 20.0, 20.0))
    return {"mlp": models.MLP, "sleep": sleep}.get(workload, models.TRANSFORMER)


def _setup(rank: int, world: int, schedule: str, workload: str) -> tuple[list[Any], Any, Any]:
    spec = spec_of(workload)
    return models.build_parts(spec, num_stages(schedule, world)), *models.make_batch(spec)


def side_worker(rank: int, world: int, args: dict[str, Any]) -> None:
    """Run `steps` + 2 training steps of one side only (what py-spy records)."""
    if args["workload"].startswith("gpt-tp"):  # vs_torch_tp's PP=2 x TP=2 GPT ("gpt-tp-sp": sequence parallel)
        from benchmarks import vs_torch_tp
        from duplexpipe import make_mesh

        (side,), _, (x, y) = vs_torch_tp.build_sides(args["schedule"], args["workload"].endswith("-sp"),
                                                    vs_torch_tp.VsTorchTPConfig(), make_mesh(2, tp=2), (args["side"],))
        harness.RoundRobin([side], lambda p, _: p.step(x, y)).run(args["steps"] + 2)
        return
    parts, x, y = _setup(rank, world, args["schedule"], args["workload"])
    pipe: Any = (build_pipeline(args["schedule"], parts, 8,
                                safety=SafetyConfig(check_inputs_every_step=not args["fixed_shapes"]))
                 if args["side"] == "ours" else build_torch_pipe(args["schedule"], parts, rank, world, 8))
    harness.RoundRobin([pipe], lambda p, _: p.step(x, y)).run(args["steps"] + 2)


def whatif_worker(rank: int, world: int, case: tuple[str, str, int]) -> list[list[float]]:
    """One bare runtime per WHATIF_VARIANTS entry; each round times a step of each, the order rotating."""
    schedule, workload, steps = case
    parts, x, y = _setup(rank, world, schedule, workload)
    pipes = [build_ours(schedule, parts, rank, world, 8, record_timeline=False, check_inputs_every_step=(i == 0))
             for i in range(len(WHATIF_VARIANTS))]
    traces = harness.RoundRobin(pipes, lambda p, _: float(p.step(x, y).loss)).run(steps, warmup=2)
    return [t.wall for t in traces]


def lookahead_worker(rank: int, world: int, job: tuple[ProfileConfig, str, str, int]) -> list[dict[str, Any]]:
    """One Pipeline (at every depth in turn) and one torch pipe; a step of each variant per round, rotating."""
    cfg, schedule, workload, steps = job
    parts, x, y = _setup(rank, world, schedule, workload)
    ours = build_pipeline(schedule, parts, 8, safety=SafetyConfig(check_inputs_every_step=not cfg.fixed_shapes))
    steppers: list[tuple[int | None, Any]] = [*((d, ours) for d in cfg.lookahead),
                                              (None, build_torch_pipe(schedule, parts, rank, world, 8))]

    def step(stepper: tuple[int | None, Any], _: int) -> Any:
        depth, pipe = stepper
        if depth is not None:
            pipe.runtime.config.recv_lookahead = depth
        return pipe.step(x, y)

    return [{"wall": t.wall, "cpu": t.cpu} for t in harness.RoundRobin(steppers, step).run(steps, warmup=2)]


def lookahead(cfg: ProfileConfig) -> dict[str, dict[str, float]]:
    """Per variant: median wall ms, median CPU ms over the ranks, the ratio to torch (of medians, and paired)."""
    per_rank = harness.spawn(lookahead_worker, (cfg, *cfg.cases[0]), cfg.world, 900)
    names = [f"lookahead {d}" for d in cfg.lookahead] + ["torch"]
    torch_wall = per_rank[0][-1]["wall"]
    found = {}
    for k, name in enumerate(names):
        wall = per_rank[0][k]["wall"]
        cpu = [sum(step) for step in zip(*(r[k]["cpu"] for r in per_rank), strict=True)]
        found[name] = {"wall_ms": 1e3 * statistics.median(wall), "cpu_ms": 1e3 * statistics.median(cpu),
                       "ratio": statistics.median(wall) / statistics.median(torch_wall),
                       "paired": statistics.median(a / b for a, b in zip(wall, torch_wall, strict=True))}
    return found


def whatif(case: tuple[str, str, int], world: int) -> dict[str, Any]:
    """Median step time of each runtime variant (what the per-step agreement costs)."""
    walls = harness.spawn(whatif_worker, case, world, 600)[0]
    med = {v: statistics.median(w) for v, w in zip(WHATIF_VARIANTS, walls, strict=True)}
    return {"schedule": case[0], "workload": case[1], "median_s": med,
            "speedup": {k: med[WHATIF_VARIANTS[0]] / v for k, v in med.items()}}


def _frame_name(frame: str) -> str:
    """`func (file.py)` without the line number."""
    name, _, where = frame.partition(" (")
    return f"{name} ({os.path.basename(where.split(':')[0])})"


def summarize_raw(path: str, side: str, steps: int, ranks: int, rate: int, top: int = 25) -> dict[str, Any]:
    """Bucket py-spy's stacks inside the step: ms per step and rank, shares, the top functions (inclusive, self)."""
    buckets: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit() or not any(f in stack for f in STEP_FRAMES):
                continue
            n = int(count)
            total += n
            buckets[next((name for name, frames in BUCKETS[side] if any(f in stack for f in frames)), "other")] += n
            frames = [_frame_name(f) for f in stack.split(";")]
            for name in set(frames[next(i for i, f in enumerate(frames) if "step (" in f):]):
                inclusive[name] += n
            own[frames[-1]] += n
    per = 1e3 / (rate * steps * ranks)
    return {"samples": total, "ms_per_step_rank": {k: v * per for k, v in buckets.most_common()},
            "share": {k: v / total for k, v in buckets.most_common()} if total else {},
            "step_ms_under_profiler": total * per, "inclusive_ms": {k: v * per for k, v in inclusive.most_common(top)},
            "self_ms": {k: v * per for k, v in own.most_common(top)}}


def profile(cfg: ProfileConfig, side: str, case: tuple[str, str, int], spy: str) -> dict[str, Any]:
    """py-spy over a fresh run of one side; the bucketed profile."""
    args = {"side": side, **dict(zip(("schedule", "workload", "steps"), case, strict=True)),
            "fixed_shapes": cfg.fixed_shapes}
    program = ("from benchmarks import harness; from benchmarks.profile_runtime import side_worker; "
               f"harness.spawn(side_worker, {args!r}, {cfg.world}, 900)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "raw.txt")
        cmd = [spy, "record", *(() if cfg.cpu else ("--idle",)), "--subprocesses", "-r", str(cfg.rate), "--format",
               "raw", "-o", out, "--", sys.executable, "-c", program]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False, cwd=runner.ROOT)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"py-spy failed ({proc.returncode}): {proc.stderr[-3000:]}")
        return summarize_raw(out, side, case[2] + 2, cfg.world, cfg.rate, max(cfg.top, 25))


def run(cfg: ProfileConfig) -> Result:
    """The profiles (when py-spy is installed) and the what-if runs; or only the look-ahead comparison."""
    if cfg.lookahead:
        return {"lookahead": lookahead(cfg), "config": asdict(cfg)}
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")  # if installed
    cases = [{"schedule": c[0], "workload": c[1], "steps": c[2], "ours": profile(cfg, "ours", c, spy),
              "torch": profile(cfg, "torch", c, spy)} for c in cfg.cases] if spy else []
    return {"cases": cases, "skipped": "" if spy else "py-spy is not installed (.venv/bin/pip install py-spy)",
            "whatif": [whatif(c, cfg.world) for c in cfg.whatif], "config": asdict(cfg)}


def report(result: Result) -> list[Block]:
    """Time buckets per case and side, the top functions (when asked), the what-if and look-ahead tables."""
    if "lookahead" in result:
        return [[["variant", "wall ms", "CPU ms (all ranks)", "ours/torch", "paired"]] + [
            [k, f"{r['wall_ms']:.1f}", f"{r['cpu_ms']:.1f}", f"{r['ratio']:.3f}", f"{r['paired']:.3f}"]
            for k, r in result["lookahead"].items()]]
    sides = [(case, side, case[side]) for case in result["cases"] for side in ("ours", "torch")]
    out: list[Block] = [[["case", "side", "where the step time goes", "ms per step and rank", "share"]]
                        + ([["-", "-", f"not profiled: {result['skipped']}", "-", "-"]] if result["skipped"] else [])
                        + [[f"{c['schedule']}, {c['workload']}", side, label, f"{v:.2f}", f"{p['share'][label]:.1%}"]
                           for c, side, p in sides for label, v in p["ms_per_step_rank"].items()]]
    top = result.get("config", {}).get("top", 0)
    for c, side, p in sides if top else []:
        pairs = zip(list(p["inclusive_ms"].items())[:top], list(p["self_ms"].items())[:top], strict=False)
        out += [f"Top functions, {c['schedule']}, {c['workload']}, {side}:",
                [["function", "inclusive ms", "", "function (self)", "self ms"]]
                + [[a, f"{x:.2f}", "", b, f"{y:.2f}"] for (a, x), (b, y) in pairs]]
    return out + ["What-if runs (bare runtimes in the same processes, one step of each per round, order rotating):",
                  [["what-if run", "runtime variant", "median step ms", "speedup vs as shipped"]]
                  + [[f"{w['schedule']}, {w['workload']} model", v, ms(med), f"{w['speedup'][v]:.2f}x"]
                     for w in result["whatif"] for v, med in w["median_s"].items()]]


PART = Part("profile_runtime", "Profile (py-spy, --idle): where a rank's step time goes", ProfileConfig(), QUICK, run,
            report, block="profile")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
