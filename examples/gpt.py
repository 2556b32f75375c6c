"""A small GPT-style causal transformer trained character-level on a public-domain corpus, pipelined.

The model and data live in the package (`duplexpipe.launch.tasks.gpt`, the default task of `duplexpipe train`);
this script is a thin user of them.

Run it:      python examples/gpt.py --schedule dualpipe --ranks 4 --steps 200
Or torchrun: torchrun --nproc-per-node 4 examples/gpt.py --ranks 4
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from duplexpipe.launch.tasks.gpt import (  # noqa: F401  (re-exported for users of this example)
    CharCorpus,
    GPTConfig,
    build_gpt,
    gpt_task,
    lm_loss,
)
from duplexpipe.launch.train_config import MetricsConfig, default_pipeline
from duplexpipe.launch.train_loop import TrainConfig, TrainResult, run_training

DemoResult = TrainResult
"""What `run_demo` returns: losses per step, tokens/s and the measured timeline of all ranks."""


def run_demo(schedule: str = "dualpipe", ranks: int = 4, microbatches: int = 8, steps: int = 200,
             out_dir: str | None = "demo-output", progress: bool = True, **task_options: Any) -> DemoResult:
    """Train the GPT with `schedule` on `ranks` local CPU processes; return losses, tokens/s, timeline.

    The timeline is the last step's measured events, gathered from every rank. With `out_dir`
    it also writes metrics.jsonl, losses.json, timeline.json and partition.txt there. Call it
    under `if __name__ == "__main__":` (the ranks are spawned processes).
    """
    n_layer = task_options.pop("n_layer", None)
    pipeline = replace(default_pipeline(), schedule=schedule, num_microbatches=microbatches)
    config = TrainConfig(ranks=ranks, steps=steps, pipeline=pipeline, task_options=dict(task_options),
                         metrics=MetricsConfig(out_dir=out_dir, progress=progress))
    config.task_options["n_layer"] = n_layer or config.parts_needed()
    return run_training(config)


def main(argv: list[str] | None = None) -> int:
    """`python examples/gpt.py`: train and print a short report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="dualpipe")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out-dir", default="demo-output")
    args = parser.parse_args(argv)
    result = run_demo(args.schedule, args.ranks, args.microbatches, args.steps, args.out_dir)
    if result.losses:  # under torchrun only rank 0 has the results
        print(result.partition)
        print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, {result.items_per_s:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
