"""Pipeline your own nn.Sequential: split it by parameter count and train it with any schedule.

Run on local CPU processes:   python examples/train_sequential.py --ranks 2 --schedule 1f1b
Run under torchrun:           torchrun --nproc-per-node 2 examples/train_sequential.py
Two "nodes" on one machine:   torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 1 \
                                  --master-addr 127.0.0.1 --master-port 29511 examples/train_sequential.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.launch.processes import run
from duplexpipe.train.trainer import Pipeline, PipelineConfig


def make_model(seed: int = 0, width: int = 64, depth: int = 6) -> nn.Sequential:
    """The user's model: an MLP regressor, initialised from `seed`."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def make_batch(step: int, batch_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data, the same on every rank for a given step."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch_size, 16, generator=gen)
    w = torch.linspace(-0.3, 0.3, 16)
    return x, torch.sin(x @ w).unsqueeze(1)


def train(schedule: str, microbatches: int, steps: int) -> dict[str, object]:
    """Runs on every rank: build, split, train; returns this rank's losses and its partition."""
    model = make_model()
    config = PipelineConfig(schedule=schedule, num_microbatches=microbatches, grad_clip_norm=1.0)
    pipe = Pipeline.from_layers(model, nn.functional.mse_loss,
                                lambda params: torch.optim.Adam(params, lr=3e-3), config, balance="params")
    losses = [pipe.step(*make_batch(step)) for step in range(steps)]
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "losses": losses,
            "partition": str(pipe.partition)}


def main(argv: list[str] | None = None) -> int:
    """Parse options, run on every rank, and report from rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="local processes when not under torchrun")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="print rank 0's result as JSON")
    args = parser.parse_args(argv)
    result = run(train, args.ranks, (args.schedule, args.microbatches, args.steps))[0]
    if result["rank"] == 0:
        if args.json:
            print(json.dumps(result))
        else:
            losses = result["losses"]
            assert isinstance(losses, list)
            print(result["partition"])
            print(f"{args.schedule} on {result['world']} ranks: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
