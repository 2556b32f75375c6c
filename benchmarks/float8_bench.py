"""Part: float8 compute on the GPT example: loss against fp32 and bf16; on FP8 hardware tokens/s against bf16 on a GPT
large enough to be GEMM-bound (`SpeedConfig`), else the report says it was not measured."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from benchmarks import harness, runner
from benchmarks.framework import Block, Part, Result, mark
from duplexpipe import PipelineConfig
from duplexpipe.launch.tasks.gpt import gpt_task
from duplexpipe.train.float8 import has_fp8_gemm
from duplexpipe.train.pipeline_config import ObserveConfig, PrecisionConfig, SafetyConfig

TARGET_LOSS = 0.02  # |float8's mean of the last losses - bf16's| / bf16's, at most
TARGET_SPEED = 1.2  # float8 tokens/s over bf16's, at least (measured only with FP8 GEMMs)
SEQ = 64  # characters per sequence (the GPT example's block size)
HEAD_DIM = 128  # the speed run's attention head width


@dataclass(frozen=True)
class SpeedConfig:
    """The tokens/s run on FP8 hardware: bf16 against float8 (bf16 autocast around both, as torchtitan trains) on a GPT
    whose linears are GEMM-bound, both compiled, round-robin on the same batches, on one GPU."""

    n_layer: int = 4  # GPT blocks
    d_model: int = 4096  # width: every block's GEMMs are (tokens x 4096) by (4096 x 4096) or (4096 x 16384)
    n_head: int = 32  # attention heads (of HEAD_DIM)
    batch_size: int = 512  # sequences of SEQ characters per step
    microbatches: int = 4  # microbatches per step: batch_size * SEQ / microbatches tokens per GEMM
    steps: int = 20  # measured steps of each variant
    warmup: int = 3  # unmeasured steps first (the compiles)
    compile: bool = True  # torch.compile both variants (torchao's casts fused; float8 needs it to be fast)
    ranks: int = 1  # pipeline ranks (one GPU each)

    def model(self) -> str:
        """The model, named for the report."""
        params = self.n_layer * 12 * self.d_model ** 2
        tokens = self.batch_size * SEQ // self.microbatches
        return (f"GPT, {self.n_layer} blocks of d_model {self.d_model} ({params / 1e6:,.0f}M block parameters), "
                f"{tokens:,} tokens per microbatch")


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
    speed_layers: int = SpeedConfig.n_layer  # the GPU speed run's GPT blocks (`SpeedConfig`; with FP8 GEMMs only)
    speed_width: int = SpeedConfig.d_model  # its d_model (heads of HEAD_DIM)
    speed_steps: int = SpeedConfig.steps  # its measured steps per variant

    def __post_init__(self) -> None:
        if self.steps < self.last:
            raise ValueError(f"steps must be >= last ({self.last}), got {self.steps}")
        if self.speed_width % HEAD_DIM:
            raise ValueError(f"speed_width must be a multiple of {HEAD_DIM}, got {self.speed_width}")

    def speed(self) -> SpeedConfig:
        """The GPU speed run's config."""
        return replace(SPEED, n_layer=self.speed_layers, d_model=self.speed_width,
                       n_head=self.speed_width // HEAD_DIM, steps=self.speed_steps)


SPEED = SpeedConfig()
QUICK = Float8BenchConfig(steps=3, last=2, n_layer=2, d_model=32, batch_size=8, speed_layers=1, speed_width=256,
                          speed_steps=2)
"""A smoke run: on FP8 hardware its speed run is a toy (named in the report), not a figure."""
DRY_SPEED = SpeedConfig(n_layer=1, d_model=32, n_head=2, batch_size=4, microbatches=2, steps=1, warmup=0,
                        compile=False)
"""The speed run at toy size: what a machine without FP8 GEMMs runs to check the CUDA path's setup (emulated)."""


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
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type}


def speed_configs(cfg: SpeedConfig) -> dict[str, PipelineConfig]:
    """variant -> PipelineConfig of the speed run: bf16, and float8 with bf16 around it."""
    return {name: PipelineConfig(
        schedule="1f1b", num_microbatches=cfg.microbatches, precision=precision, compile=cfg.compile,
        observe=ObserveConfig(record_timeline=False), safety=SafetyConfig(check_inputs_every_step=False))
        for name, precision in (("bf16", PrecisionConfig("bf16")),
                                ("float8", PrecisionConfig("bf16", float8="tensorwise")))}


def _speed_worker(rank: int, world: int, cfg: SpeedConfig) -> dict[str, float]:
    task = gpt_task(n_layer=cfg.n_layer, d_model=cfg.d_model, n_head=cfg.n_head, block_size=SEQ)
    configs = speed_configs(cfg)
    pipes = [harness.gpt_pipeline(task, config, harness.adamw(3e-4)) for config in configs.values()]
    traces = harness.RoundRobin(pipes, harness.gpt_step(task, cfg.batch_size)).run(cfg.steps, warmup=cfg.warmup)
    tokens = cfg.batch_size * SEQ
    return {name: tokens / statistics.median(t.wall) for name, t in zip(configs, traces, strict=True)}


def measure_speed(cfg: SpeedConfig, backend: str) -> dict[str, float]:
    """variant -> median tokens/s of the speed run on `cfg.ranks` ranks of `backend`."""
    result: dict[str, float] = harness.spawn(_speed_worker, cfg, cfg.ranks, 3600, backend=backend)[0]
    return result


def speed_verdict(cfg: SpeedConfig = SPEED) -> dict[str, Any]:
    """The tokens/s float8 / bf16 of the speed run where the first CUDA device has FP8 GEMMs; else why not, and the
    model it would be measured on."""
    if not torch.cuda.is_available():
        return {"ratio": None, "why": "this machine has no CUDA GPU", "model": cfg.model()}
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    if not has_fp8_gemm(device):
        return {"ratio": None, "why": f"{name} has no FP8 GEMMs", "model": cfg.model()}
    rates = measure_speed(cfg, "nccl")
    return {"ratio": rates["float8"] / rates["bf16"], "tokens_per_s": rates, "model": cfg.model(), "device": name}


def run(cfg: Float8BenchConfig) -> Result:
    """Train the variants; per variant the mean of the last losses and the median tokens/s; then the speed run."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    lead = harness.spawn(_worker, cfg, cfg.ranks, 3600, backend=backend)[0]
    tokens = cfg.batch_size * SEQ
    rows = {name: {"loss_last": statistics.fmean(losses[-cfg.last:]), "losses": losses,
                   "tokens_per_s": tokens / statistics.median(lead["seconds"][name])}
            for name, losses in lead["losses"].items()}
    bf16 = rows["bf16"]
    return {"rows": rows, "loss_ratio": rows["float8"]["loss_last"] / bf16["loss_last"],
            "loss_ratio_fp32": rows["float8"]["loss_last"] / rows["fp32"]["loss_last"],
            "speed": speed_verdict(cfg.speed()), "device": lead["device"], "config": asdict(cfg)}


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
    speed = result["speed"]
    if speed["ratio"] is None:
        lines.append(f"GPU tokens/s float8 / bf16 was not measured: {speed['why']} (on an H100 or newer this part "
                     f"measures it on {speed['model']}, target >= {TARGET_SPEED}x). The tokens/s above are "
                     "not a float8 figure: float8 ran emulated, slower by design.")
    else:
        rates = speed["tokens_per_s"]
        lines.append(f"Tokens/s float8 / bf16 on {speed['device']}, {speed['model']}: {speed['ratio']:.2f}x "
                     f"({rates['float8']:,.0f} / {rates['bf16']:,.0f}; target >= {TARGET_SPEED}x: "
                     f"{mark(speed['ratio'] >= TARGET_SPEED)}).")
    return lines


PART = Part("float8_bench", "Float8 compute in the stages", Float8BenchConfig(), QUICK, run, report,
            in_bench=False)  # 200 steps three times: minutes on CPU; run when named

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
