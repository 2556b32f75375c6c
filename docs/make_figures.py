"""Regenerate the figures in docs/img: `python docs/make_figures.py [OUT_DIR]`."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from duplexpipe.schedules import registry
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.viz import plot_comparison, plot_timeline

COMPARED = ("1f1b", "zb-h1", "dualpipe", "dualpipev")


def cost_model() -> CostModel:
    """The default costs (F=1, B=2, W=1, F&B=3), scaled per stage like `duplexpipe compare` does."""
    cost = CostModel()
    if any(f.name == "stage_scale" for f in dataclasses.fields(cost)):
        cost = dataclasses.replace(cost, stage_scale=True)
    return cost


def main(out_dir: Path) -> list[Path]:
    """Write the comparison figure and the DualPipe Gantt chart; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cost = cost_model()
    compare = out_dir / "compare_1f1b_dualpipe.png"
    timelines = [simulate(registry.build(name, 4, 8), cost) for name in COMPARED]
    plot_comparison(timelines, compare, title="1F1B vs ZB-H1 vs DualPipe vs DualPipeV \u00b7 4 ranks \u00b7 "
                                              "8 microbatches")
    gantt = out_dir / "dualpipe_gantt.png"
    plot_timeline(simulate(registry.build("dualpipe", 8, 16), cost), gantt, activations=True)
    return [compare, gantt]


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "img"
    for written in main(target):
        print(f"wrote {written}")
