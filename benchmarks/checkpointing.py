"""Part: activation checkpointing under the split backward: checkpointed / plain step time per schedule, and how
often a checkpointed block's forward runs (once recomputed per microbatch, against torch's checkpoint's once per
engine call)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from benchmarks import harness
from benchmarks.framework import Block, Part, Result, met
from benchmarks.runner import main
from duplexpipe import Pipeline, PipelineConfig
from duplexpipe.train.pipeline_config import ObserveConfig

ZB_VS_1F1B = 1.0
"""Target: ZB-H1 with checkpointing at most this times 1F1B with checkpointing."""
ZB_CKPT_VS_PLAIN = 1.4
"""Target: ZB-H1 with checkpointing at most this times ZB-H1 without."""
TORCH = "zb-h1 torch checkpoint"
"""The run whose blocks call torch's checkpoint themselves (what checkpointing did before: one recompute per engine
call)."""


@dataclass(frozen=True)
class CheckpointingBenchConfig:
    """`blocks` residual MLP blocks (LayerNorm, up, tanh, down: three param groups each) of width `dim` in a pipeline
    on `ranks` CPU processes, `microbatches` per step of `rows` rows, every schedule plain and with full checkpointing
    (and ZB-H1 with torch's checkpoint in the blocks), all stepping in turn round by round so a disturbance of the
    shared machine falls on all alike."""

    schedules: tuple[str, ...] = ("1f1b", "zb-h1", "zb-h2", "zbv", "dualpipe", "dualpipev")
    blocks: int = 8
    dim: int = 512
    rows: int = 256
    microbatches: int = 8
    warmup: int = 2
    rounds: int = 10
    ranks: int = 4


QUICK = CheckpointingBenchConfig(schedules=("1f1b", "zb-h1"), blocks=4, dim=16, rows=16, microbatches=4, warmup=1,
                                 rounds=2, ranks=2)


class CountedBlock(nn.Module):
    """x + down(tanh(up(norm(x)))), counting its forward runs; `torch_checkpoint`: it checkpoints itself with torch's
    checkpoint."""

    def __init__(self, dim: int, torch_checkpointed: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.calls = 0
        self.torch_checkpointed = torch_checkpointed

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.down(torch.tanh(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.torch_checkpointed and torch.is_grad_enabled():
            out: torch.Tensor = torch_checkpoint(self.inner, x, use_reentrant=False)
            return out
        return self.inner(x)


def _names(cfg: CheckpointingBenchConfig) -> list[str]:
    names = [f"{s} {how}" for s in cfg.schedules for how in ("plain", "checkpointed")]
    return names + ([TORCH] if "zb-h1" in cfg.schedules else [])


def _pipeline(cfg: CheckpointingBenchConfig, name: str) -> Pipeline:
    schedule, how = name.split(" ", 1)
    torch.manual_seed(0)
    layers = [CountedBlock(cfg.dim, how == "torch checkpoint") for _ in range(cfg.blocks)]
    config = PipelineConfig(schedule, cfg.microbatches, activation_checkpointing=how == "checkpointed",
                            observe=ObserveConfig(record_timeline=False))
    return Pipeline.from_layers(layers, nn.functional.mse_loss, harness.sgd(1e-3, 0.0), config)


def _batch(cfg: CheckpointingBenchConfig, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    return torch.randn(cfg.rows, cfg.dim, generator=gen), torch.randn(cfg.rows, cfg.dim, generator=gen)


def _calls(pipe: Pipeline) -> dict[str, int]:
    """Forward runs of this rank's blocks since the last reset, by global block name (and reset them)."""
    out = {}
    for module in pipe.stage_modules.values():
        for name, block in module.named_modules():
            if isinstance(block, CountedBlock):
                out[name.rsplit(".", 1)[-1]] = block.calls
                block.calls = 0
    return out


def worker(rank: int, world: int, cfg: CheckpointingBenchConfig) -> dict[str, Any]:
    """Every run's step seconds (round robin), then one more step each, its blocks' forward runs counted."""
    names = _names(cfg)
    pipes = [_pipeline(cfg, name) for name in names]
    traces = harness.RoundRobin(pipes, lambda p, i: p.step(*_batch(cfg, i))).run(cfg.rounds, warmup=cfg.warmup)
    calls = {}
    for name, pipe in zip(names, pipes, strict=True):
        _calls(pipe)
        dist.barrier()
        pipe.step(*_batch(cfg, 0))
        calls[name] = _calls(pipe)
    return {"wall": {n: t.wall for n, t in zip(names, traces, strict=True)}, "calls": calls}


def run(cfg: CheckpointingBenchConfig) -> Result:
    """The runs on `cfg.ranks` processes: per run, each round's slowest-rank step seconds, and per block its forward
    runs in one step summed over the ranks (DualPipe's copies of a part each run half the microbatches)."""
    results = harness.spawn(worker, cfg, cfg.ranks, 3600.0)
    names = list(results[0]["wall"])
    calls: dict[str, dict[str, int]] = {}
    for name in names:
        summed: dict[str, int] = {}
        for r in results:
            for block, n in r["calls"][name].items():
                summed[block] = summed.get(block, 0) + n
        calls[name] = summed
    return {"config": asdict(cfg), "rounds_s": {n: results[0]["wall"][n] for n in names}, "calls": calls}


def _paired(rounds: dict[str, list[float]], num: str, den: str) -> float:
    """The median over rounds of num / den (each round's pair measured side by side)."""
    return statistics.median(a / b for a, b in zip(rounds[num], rounds[den], strict=True))


def runs_per_microbatch(result: Result, name: str) -> float:
    """The most forward runs of one block in a step, per microbatch."""
    return max(result["calls"][name].values()) / result["config"]["microbatches"]


def report(result: Result) -> list[Block]:
    """The table (per schedule: plain and checkpointed step, their ratio, the forward runs per microbatch) and the
    targets."""
    cfg, rounds = result["config"], result["rounds_s"]
    ms = {n: 1e3 * statistics.median(t) for n, t in rounds.items()}
    table = [["schedule", "plain ms", "checkpointed ms", "checkpointed / plain", "block forwards per microbatch"]]
    for schedule in cfg["schedules"]:
        plain, ckpt = f"{schedule} plain", f"{schedule} checkpointed"
        table.append([schedule, f"{ms[plain]:.1f}", f"{ms[ckpt]:.1f}", f"{_paired(rounds, ckpt, plain):.2f}",
                      f"{runs_per_microbatch(result, ckpt):g}"])
    if TORCH in rounds:
        table.append(["zb-h1, torch's checkpoint", f"{ms['zb-h1 plain']:.1f}", f"{ms[TORCH]:.1f}",
                      f"{_paired(rounds, TORCH, 'zb-h1 plain'):.2f}", f"{runs_per_microbatch(result, TORCH):g}"])
    blocks: list[Block] = [
        f"{cfg['blocks']} residual MLP blocks (width {cfg['dim']}), {cfg['rows']} rows in {cfg['microbatches']} "
        f"microbatches, {cfg['ranks']} CPU processes (gloo), median of {len(next(iter(rounds.values())))} rounds; "
        "ratios are medians of per-round ratios. A block's forward runs once in the forward and once more per "
        "recompute.", table]
    if "zb-h1" in cfg["schedules"] and "1f1b" in cfg["schedules"]:
        vs_1f1b = _paired(rounds, "zb-h1 checkpointed", "1f1b checkpointed")
        vs_plain = _paired(rounds, "zb-h1 checkpointed", "zb-h1 plain")
        blocks.append(f"ZB-H1 with checkpointing is {vs_1f1b:.2f}x 1F1B with checkpointing (target at most "
                      f"{ZB_VS_1F1B:g}x: {met(vs_1f1b <= ZB_VS_1F1B)}) and {vs_plain:.2f}x ZB-H1 without (target at "
                      f"most {ZB_CKPT_VS_PLAIN:g}x: {met(vs_plain <= ZB_CKPT_VS_PLAIN)}).")
    return blocks


PART: Part[CheckpointingBenchConfig] = Part(
    name="checkpointing", title="Activation checkpointing under the split backward", config=CheckpointingBenchConfig(),
    quick=QUICK, run=run, report=report)

if __name__ == "__main__":
    raise SystemExit(main(only="checkpointing"))
