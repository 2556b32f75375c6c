"""Part: float8 compute on the GPT example: loss against fp32 and bf16, on FP8 hardware tokens/s against bf16."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks import harness, runner
from benchmarks.framework import Block, Part, Result, mark
from duplexpipe import PipelineConfig
from duplexpipe.train.float8 import has_fp8_gemm
from duplexpipe.train.pipeline_config import ObserveConfig, PrecisionConfig, SafetyConfig

TARGET_LOSS = 0.02  # |float8's mean of the last losses - bf16's| / bf16's, at most
TARGET_SPEED = 1.2  # float8 tokens/s over bf16's, at least (measured only with FP8 GEMMs)
SEQ = 64  # characters per sequence (the GPT example's block size)


@dataclass(frozen=True)
class Float8BenchConfig:
    """One spawn trains a Pipeline per variant (fp32, bf16, float8) from the same weights, round-robin on the same
    batches."""

    schedule: str = "1f1b"  # the pipeline schedule
    ranks: int = 2  # pipeline ranks (gloo, or NCCL with a GPU each)
    microbatches: int = 4  # microbatches per step
    steps: int = 200  # training steps of every variant
    last: int = 20  # the loss figure is the mean of this many last steps
    n_layer: int = 4  # GPT blocks
    d_model: int = 64  # GPT width (every block's linears are d_model x d_model or d_model x 4 d_model: all convert)
    batch_size: int = 16  # sequences per step (each of SEQ characters)
    lr: float = 3e-3  # AdamW learning rate
    recipe: str = "tensorwise"  # the torchao recipe

    def __post_init__(self) -> None:
        if self.steps < self.last:
            raise ValueError(f"steps must be >= last ({self.last}), got {self.steps}")


QUICK = Float8BenchConfig(steps=3, last=2, n_layer=2, d_model=32, batch_size=8)


def _variants(recipe: str) -> dict[str, PrecisionConfig]:
    """fp32, bf16 (autocast) and float8: on CUDA with bf16 autocast around it (as torchtitan trains), on the CPU in
    fp32 (torchao's Float8Linear takes the autocast dtype from CUDA's)."""
    float8_dtype = "bf16" if torch.cuda.is_available() else "fp32"
    return {"fp32": PrecisionConfig("fp32"), "bf16": PrecisionConfig("bf16"),
            "float8": PrecisionConfig(float8_dtype, float8=recipe)}


def _worker(rank: int, world: int, cfg: Float8BenchConfig) -> dict[str, Any]:
    task = harness.gpt(n_layer=cfg.n_layer, d_model=cfg.d_model)
    variants = _variants(cfg.recipe)
    pipes = [harness.gpt_pipeline(task, PipelineConfig(
        schedule=cfg.schedule, num_microbatches=cfg.microbatches, grad_clip_norm=1.0, precision=precision,
        observe=ObserveConfig(record_timeline=False), safety=SafetyConfig(check_inputs_every_step=False)),
        harness.adamw(cfg.lr)) for precision in variants.values()]
    traces = harness.RoundRobin(pipes, harness.gpt_step(task, cfg.batch_size)).run(cfg.steps)
    device = pipes[0].device
    return {"losses": {k: t.out for k, t in zip(variants, traces, strict=True)},
            "seconds": {k: t.wall for k, t in zip(variants, traces, strict=True)},
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "fp8_gemms": has_fp8_gemm(device)}


def run(cfg: Float8BenchConfig) -> Result:
    """Train the variants; per variant the mean of the last losses and the median tokens/s."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    lead = harness.spawn(_worker, cfg, cfg.ranks, 3600, backend=backend)[0]
    tokens = cfg.batch_size * SEQ
    rows = {name: {"loss_last": statistics.fmean(losses[-cfg.last:]), "losses": losses,
                   "tokens_per_s": tokens / statistics.median(lead["seconds"][name])}
            for name, losses in lead["losses"].items()}
    bf16 = rows["bf16"]
    return {"rows": rows, "loss_ratio": rows["float8"]["loss_last"] / bf16["loss_last"],
            "loss_ratio_fp32": rows["float8"]["loss_last"] / rows["fp32"]["loss_last"],
            "speed_ratio": rows["float8"]["tokens_per_s"] / bf16["tokens_per_s"] if lead["fp8_gemms"] else None,
            "device": lead["device"], "config": asdict(cfg)}


def report(result: Result) -> list[Block]:
    """One row per variant, then the two verdicts."""
    cfg = result["config"]
    table = [["variant", f"loss, mean of last {cfg['last']}", "vs bf16", "tokens/s (median step)"]]
    for name, row in result["rows"].items():
        table.append([name, f"{row['loss_last']:.4f}", f"{row['loss_last'] / result['rows']['bf16']['loss_last']:.4f}",
                      f"{row['tokens_per_s']:,.0f}"])
    ratio = result["loss_ratio"]
    lines: list[Block] = [
        f"GPT example ({cfg['n_layer']} blocks, d_model {cfg['d_model']}), {cfg['schedule']} on {cfg['ranks']} ranks, "
        f"{cfg['steps']} steps, float8 {cfg['recipe']} on {result['device']}.", table,
        f"Final loss float8 / bf16: {ratio:.4f} (float8 / fp32: {result['loss_ratio_fp32']:.4f}); target within "
        f"{TARGET_LOSS:.0%}: {mark(abs(ratio - 1) <= TARGET_LOSS)}."]
    speed = result["speed_ratio"]
    if speed is None:
        lines.append(f"Speed was not measured: {result['device']} has no FP8 GEMMs (float8 ran emulated, which is "
                     "slower by design); the tokens/s above are not a float8 figure.")
    else:
        lines.append(f"Tokens/s float8 / bf16 on {result['device']}: {speed:.2f}x (target >= {TARGET_SPEED}x: "
                     f"{mark(speed >= TARGET_SPEED)}).")
    return lines


PART = Part("float8_bench", "Float8 compute in the stages", Float8BenchConfig(), QUICK, run, report,
            in_bench=False)  # 200 steps three times: minutes on CPU; run when named

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
