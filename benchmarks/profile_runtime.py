"""Profile one side of the A/B run under py-spy and say where a rank's step time goes."""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import harness, models  # noqa: E402

BUCKETS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "ours": (
        ("wait for a receive (Transport.take)", ("Transport.take (",)),
        ("step-start agreement (star of messages)", ("agree (",)),
        ("loss sum (SharedSum / PendingSum)", ("PendingSum.value (", "SharedSum.value (")),
        ("DualPipe mirrored-gradient exchange", ("MirrorSum.",)),
        ("end-of-step send completion", ("Transport.finish (",)),
        ("post receives (irecv)", ("Transport.expect (",)),
        ("post sends (ProcessGroup.send)", ("Transport.send (",)),
        ("reap completed sends (NCCL only)", ("Transport.reap (",)),
        ("I: autograd-graph analysis (autograd_split)", ("_parents (", "_ancestors (", "_group_params (",
                                                         "_meeting_points (")),
        ("forward compute (module + loss)", ("Dispatcher.run_forward (",)),
        ("backward compute (B, I, W)", ("Dispatcher.run_backward (", "Dispatcher.weight (")),
        ("trainer: optimizer step, norm, zero_grad", ("Pipeline._apply (", "zero_grad (")),
    ),
    "torch": (
        ("wait for P2P (_wait_batch_p2p)", ("_wait_batch_p2p (",)),
        ("post P2P (batch_isend_irecv)", ("_batch_p2p (",)),
        ("I: autograd-graph analysis (_backward.py)", ("get_param_groups (", "reverse_closure (",
                                                      "construct_reverse_graph (")),
        ("forward compute (module + loss)", ("forward_one_chunk (", "_maybe_compute_loss (")),
        ("backward compute (B, I, W)", ("backward_one_chunk (", "backward_weight_one_chunk (")),
        ("gradient scaling", ("perform_reduce_grad (", "scale_grads (")),
        ("optimizer step, zero_grad", ("Optimizer.step (", "SGD.step (", "zero_grad (")),
    ),
}
"""Per side, (label, frame texts): a sample goes to the first bucket with a frame text in its stack."""


@dataclass(frozen=True)
class ProfileArgs:
    """What the profiled workers run."""

    side: str
    """"ours" or "torch"."""
    schedule: str
    """Schedule key present in both frameworks."""
    steps: int
    """Steps to run (after two warm-up steps)."""
    workload: str
    """"mlp", "transformer" or "sleep" (F/I/W = 20 ms per stage)."""
    fixed_shapes: bool = False
    """Ours: PipelineConfig.check_inputs_every_step=False."""


def _spec(workload: str) -> models.ModelSpec:
    if workload == "mlp":
        return models.ModelSpec("mlp", num_layers=8, width=256, batch=64)
    if workload == "sleep":
        return models.ModelSpec("sleep", width=64, batch=16, sleep_ms=(20.0, 20.0, 20.0))
    return models.ModelSpec("transformer", num_layers=8, width=128, batch=32, seq=32)


def worker(rank: int, world: int, args: ProfileArgs) -> None:
    """Run `args.steps` steps of one side only."""
    from benchmarks.ours_side import build_pipeline, frozen_sgd
    from benchmarks.torch_side import TORCH_SCHEDULES, build_torch_pipe, num_stages

    spec = _spec(args.workload)
    parts = models.build_parts(spec, num_stages(TORCH_SCHEDULES[args.schedule][1], world))
    x, y = models.make_batch(spec)
    pipe: Any  # both sides as vs_torch times them: a training step with an optimizer
    if args.side == "ours":
        pipe = build_pipeline(args.schedule, parts, 8, models.loss_fn,
                              check_inputs_every_step=not args.fixed_shapes)
    else:
        pipe = build_torch_pipe(args.schedule, parts, rank, world, 8, models.loss_fn, frozen_sgd)
    for _ in range(args.steps + 2):
        pipe.zero_grad()
        harness.timed(lambda: pipe.step(x, y))


WHATIF_VARIANTS = ("as shipped (inputs agreed every step)", "check_inputs_every_step=False")
"""Runtime configurations timed step by step, in rotating order, in the same processes."""


def _step_loss(pipe: Any, x: Any, y: Any) -> float:
    return float(pipe.step(x, y).loss)


def whatif_worker(rank: int, world: int, args: ProfileArgs) -> dict[str, list[float]]:
    """One runtime per WHATIF_VARIANTS entry; each round times one step of each, order rotating."""
    from benchmarks.ours_side import build_ours, runtime_config
    from benchmarks.torch_side import TORCH_SCHEDULES, num_stages

    spec = _spec(args.workload)
    parts = models.build_parts(spec, num_stages(TORCH_SCHEDULES[args.schedule][1], world))
    x, y = models.make_batch(spec)
    pipes = {variant: build_ours(args.schedule, parts, rank, world, 8, models.loss_fn,
                                 config=runtime_config(record_timeline=False, check_inputs_every_step=(i == 0)))
             for i, variant in enumerate(WHATIF_VARIANTS)}
    out: dict[str, list[float]] = {k: [] for k in WHATIF_VARIANTS}
    for i in range(args.steps + 2):
        shift = i % len(WHATIF_VARIANTS)
        for variant in WHATIF_VARIANTS[shift:] + WHATIF_VARIANTS[:shift]:
            pipe = pipes[variant]
            pipe.zero_grad()
            elapsed = harness.timed(functools.partial(_step_loss, pipe, x, y))[0]
            if i >= 2:
                out[variant].append(elapsed)
    return out


def whatif(schedule: str = "1f1b", steps: int = 20, workload: str = "mlp") -> dict[str, Any]:
    """Median step time of each runtime variant; shows what the per-step collectives and the
    receive-wait path cost."""
    raw = harness.spawn(whatif_worker, ProfileArgs("ours", schedule, steps, workload), 4, 600)[0]
    med = {k: harness.summarize(v).median for k, v in raw.items()}
    return {"schedule": schedule, "workload": workload, "median_s": med,
            "speedup": {k: med[WHATIF_VARIANTS[0]] / v for k, v in med.items()}}


@dataclass(frozen=True)
class LookaheadArgs:
    """What the look-ahead comparison runs."""

    schedule: str
    """Schedule key present in both frameworks."""
    steps: int
    """Timed rounds (after two warm-up rounds); each round times one step of every variant."""
    workload: str
    """"mlp" or "transformer"."""
    depths: tuple[int, ...]
    """RuntimeConfig.recv_lookahead values to compare."""
    fixed_shapes: bool = False
    """Ours: PipelineConfig.check_inputs_every_step=False."""


def lookahead_worker(rank: int, world: int, args: LookaheadArgs) -> dict[str, dict[str, list[float]]]:
    """One Pipeline and one torch pipe; each round times a step of the Pipeline at every look-ahead depth
    and one of torch, order rotating. Returns per variant the wall seconds (slowest rank) and the CPU
    seconds summed over the ranks."""
    from benchmarks.ours_side import build_pipeline, frozen_sgd
    from benchmarks.torch_side import TORCH_SCHEDULES, build_torch_pipe, num_stages

    spec = _spec(args.workload)
    parts = models.build_parts(spec, num_stages(TORCH_SCHEDULES[args.schedule][1], world))
    x, y = models.make_batch(spec)
    ours = build_pipeline(args.schedule, parts, 8, models.loss_fn, check_inputs_every_step=not args.fixed_shapes)
    theirs = build_torch_pipe(args.schedule, parts, rank, world, 8, models.loss_fn, frozen_sgd)
    names = [f"lookahead {d}" for d in args.depths] + ["torch"]
    out: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for i in range(args.steps + 2):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            pipe: Any = theirs
            if name != "torch":
                pipe = ours
                ours.pipe.runtime.config.recv_lookahead = args.depths[names.index(name)]
            wall, cpu, _ = harness.timed_cpu(functools.partial(pipe.step, x, y))
            if i >= 2:
                out[name]["wall"].append(wall)
                out[name]["cpu"].append(cpu)
    return out


def lookahead(args: LookaheadArgs) -> dict[str, dict[str, float]]:
    """Per variant: median wall ms, median CPU ms (summed over ranks), and the wall ratio to torch (ratio
    of medians, and median of the per-round ratios)."""
    raw = harness.spawn(lookahead_worker, args, 4, 900)[0]
    torch_wall = raw["torch"]["wall"]
    found = {}
    for name, got in raw.items():
        paired = [a / b for a, b in zip(got["wall"], torch_wall, strict=True)]
        found[name] = {"wall_ms": 1e3 * harness.summarize(got["wall"]).median,
                       "cpu_ms": 1e3 * harness.summarize(got["cpu"]).median,
                       "ratio": harness.summarize(got["wall"]).median / harness.summarize(torch_wall).median,
                       "paired": harness.summarize(paired).median}
    return found


STEP_FRAMES = ("Pipe.step (", "OursTrainer.step (")
"""A sample counts when one of these frames (a side's timed step) is in its stack."""


def _frame_name(frame: str) -> str:
    """`func (file.py)` without the line number."""
    name, _, where = frame.partition(" (")
    return f"{name} ({os.path.basename(where.split(':')[0])})"


def summarize_raw(path: str, side: str, steps: int, ranks: int, rate: int, top: int = 25) -> dict[str, Any]:
    """Bucket py-spy's collapsed stacks inside the pipe's step(); ms per step and rank, and shares; plus
    the `top` functions by inclusive and by self samples."""
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
            label = next((name for name, frames in BUCKETS[side] if any(f in stack for f in frames)), "other")
            buckets[label] += n
            frames = [_frame_name(f) for f in stack.split(";")]
            for name in set(frames[next(i for i, f in enumerate(frames) if "step (" in f):]):
                inclusive[name] += n
            own[frames[-1]] += n
    per = 1e3 / (rate * steps * ranks)
    return {"samples": total, "ms_per_step_rank": {k: v * per for k, v in buckets.most_common()},
            "share": {k: v / total for k, v in buckets.most_common()} if total else {},
            "step_ms_under_profiler": total * per,
            "inclusive_ms": {k: v * per for k, v in inclusive.most_common(top)},
            "self_ms": {k: v * per for k, v in own.most_common(top)}}


def py_spy() -> str | None:
    """The py-spy executable next to this interpreter or on PATH, if installed."""
    return shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")


def profile(side: str, schedule: str, steps: int, workload: str, rate: int = 250, fixed_shapes: bool = False,
            cpu: bool = False) -> dict[str, Any]:
    """Run py-spy over a fresh 4-rank run of one side; return the bucketed profile (cpu: on-CPU samples
    only, so waits drop out and the figures are CPU time per step and rank)."""
    spy = py_spy()
    if spy is None:
        raise RuntimeError("py-spy is not installed; `.venv/bin/pip install py-spy`")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "raw.txt")
        cmd = [spy, "record", *(() if cpu else ("--idle",)), "--subprocesses", "-r", str(rate), "--format", "raw",
               "-o", out, "--", sys.executable, os.path.abspath(__file__), "--run", side, schedule, str(steps),
               workload, *(("--fixed-shapes",) if fixed_shapes else ())]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"py-spy failed ({proc.returncode}): {proc.stderr[-3000:]}")
        return summarize_raw(out, side, steps + 2, 4, rate)


def main(argv: list[str] | None = None) -> int:
    """`--run SIDE SCHEDULE STEPS WORKLOAD` runs the workers; otherwise profile both sides and print."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", nargs=4, metavar=("SIDE", "SCHEDULE", "STEPS", "WORKLOAD"))
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--workload", default="mlp", choices=("mlp", "transformer", "sleep"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fixed-shapes", action="store_true", help="ours: check_inputs_every_step=False")
    parser.add_argument("--cpu", action="store_true", help="on-CPU samples only (CPU time, waits left out)")
    parser.add_argument("--top", action="store_true", help="also list the top functions (inclusive, self)")
    parser.add_argument("--no-whatif", action="store_true", help="skip the runtime-variant timing")
    parser.add_argument("--lookahead", metavar="DEPTHS", help="only compare recv_lookahead depths (e.g. 0,2,4) "
                        "against torch, in the same processes, steps alternating; no profile")
    args = parser.parse_args(argv)
    if args.lookahead:
        depths = tuple(int(d) for d in args.lookahead.split(","))
        table = lookahead(LookaheadArgs(args.schedule, args.steps, args.workload, depths, args.fixed_shapes))
        for name, row in table.items():
            print(f"{args.schedule} {name:12s} wall {row['wall_ms']:7.1f} ms  cpu {row['cpu_ms']:7.1f} ms  "
                  f"ours/torch {row['ratio']:.3f}  paired {row['paired']:.3f}")
        return 0
    if args.run:
        side, schedule, steps, workload = args.run
        harness.spawn(worker, ProfileArgs(side, schedule, int(steps), workload, args.fixed_shapes), 4, 900)
        return 0
    for side in ("ours", "torch"):
        found = profile(side, args.schedule, args.steps, args.workload, fixed_shapes=args.fixed_shapes,
                        cpu=args.cpu)
        kind = "on-CPU" if args.cpu else "wall"
        print(f"{side}: {found['step_ms_under_profiler']:.1f} ms per step and rank under the profiler ({kind})")
        for label, ms in found["ms_per_step_rank"].items():
            print(f"  {ms:7.2f} ms  {found['share'][label]:6.1%}  {label}")
        if args.top:
            for title in ("inclusive_ms", "self_ms"):
                print(f"  top functions, {title}:")
                for name, ms in found[title].items():
                    print(f"    {ms:7.2f} ms  {name}")
    if not args.no_whatif:
        print(whatif(args.schedule, 20, args.workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
