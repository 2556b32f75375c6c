"""`make demo`: train a small GPT with DualPipe on 4 CPU processes, then draw and compare what ran."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import run_demo  # noqa: E402  (examples/ is not a package)

from duplexpipe.planner.calibrate import fit_cost_model  # noqa: E402
from duplexpipe.schedules import registry  # noqa: E402
from duplexpipe.schedules.compare import compare_rows  # noqa: E402
from duplexpipe.schedules.simulate import CostModel, simulate  # noqa: E402
from duplexpipe.viz import plot_comparison, plot_measured_vs_simulated, plot_timeline, to_chrome_trace  # noqa: E402


def plot_losses(losses: list[float], path: Path, title: str) -> None:
    """The loss curve as a PNG."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=120)
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, color="#2c6fbb", linewidth=1.6)
    ax.set_xlabel("step")
    ax.set_ylabel("mean cross-entropy (nats / character)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schedule", default="dualpipe", choices=registry.names())
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="demo-output")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"duplexpipe demo: a character-level GPT trained with {args.schedule} on {args.ranks} CPU processes "
          f"(gloo), {args.microbatches} microbatches per step, {args.steps} steps")
    result = run_demo(args.schedule, args.ranks, args.microbatches, args.steps, out_dir=str(out))
    print()
    print(result.partition)
    losses = result.losses
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (min {min(losses):.3f}) in {result.wall_s:.1f} s of "
          f"training, {result.tokens_per_s:,.0f} tokens/s")
    measured = result.timeline
    if measured is None:
        raise RuntimeError("the run recorded no timeline")
    schedule = registry.build(args.schedule, args.ranks, args.microbatches)
    simulated = replace(simulate(schedule, fit_cost_model(measured)), unit=measured.unit)
    files = {
        "loss curve": out / "loss.png",
        "measured Gantt chart": out / "measured_gantt.png",
        "measured vs simulated": out / "measured_vs_simulated.png",
        "Chrome/Perfetto trace": out / "trace.json",
        "all schedules, simulated": out / "compare.png",
    }
    plot_losses(losses, files["loss curve"], f"GPT, {args.schedule}, {args.ranks} ranks")
    plot_timeline(measured, str(files["measured Gantt chart"]), activations=True)
    plot_measured_vs_simulated(measured, simulated, str(files["measured vs simulated"]))
    to_chrome_trace(measured, str(files["Chrome/Perfetto trace"]))
    _, timelines = compare_rows(args.ranks, args.microbatches, CostModel(stage_scale=True))  # per 1/P of the model
    plot_comparison(timelines, str(files["all schedules, simulated"]))
    print(f"last step, measured: makespan {measured.makespan * 1e3:.1f} ms, bubble ratio {measured.bubble_ratio:.1%}")
    print(f"simulated with the measured per-stage costs: makespan {simulated.makespan * 1e3:.1f} ms, "
          f"bubble ratio {simulated.bubble_ratio:.1%}")
    cores = os.cpu_count() or 1
    if cores < args.ranks:
        print(f"note: {args.ranks} ranks share {cores} CPU cores here, so measured idle time includes waiting "
              "for a core; on one device per rank the two agree closely (see docs/benchmarks.md)")
    for label, path in files.items():
        print(f"  {label:<24} {path}")
    print(f"  {'losses, timeline':<24} {out / 'losses.json'}, {out / 'timeline.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
