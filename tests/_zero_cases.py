"""Worker-side cases for the ZeRO tests (test_dp_zero.py, test_dp_fsdp.py): each returns plain data."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _train_helpers import WIDTH, batch, make_parts, mse
from torch import Tensor, nn

from benchmarks.zero_bench import held_bytes  # one measure of held memory, for tests and benchmark
from duplexpipe import Pipeline, PipelineConfig, make_mesh
from duplexpipe.dp_options.compression import Int8Options
from duplexpipe.dp_options.zero import ZeroOptions
from duplexpipe.train.pipeline_config import DataParallelConfig, PrecisionConfig
from duplexpipe.train.precision import LossScaleConfig

BATCH = 16
CLIP = 0.05  # below the gradient norm: clipping scales every step


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with weight decay off for biases (two param groups)."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}], lr=1e-2)


def wide_parts(num_parts: int, width: int, seed: int) -> list[nn.Module]:
    """Two Linear(width, width) + Tanh blocks per part (wide enough for 256-element int8 blocks)."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
            for _ in range(num_parts)]


def build(schedule: str, zero_stage: int, dp: int, *, precision: str = "fp32", zero: ZeroOptions | None = None,
          compression: Any = None, seed: int = 0, width: int = WIDTH, window: int | None = None,
          copies: int = 1, reshard_gradients: bool | None = None, **extra: Any) -> Pipeline:
    """A pipeline over the world as pp x dp with the given ZeRO settings (fp16: a loss scale that overflows
    on the first step, so a skipped step is part of every fp16 case); `copies` model parts per pipeline rank (2 for
    ZBV), `window` ZeRO-3's reshard window and `reshard_gradients` its choice for the gradients."""
    pp = dist.get_world_size() // dp
    cfg = PipelineConfig(schedule=schedule, num_microbatches=4, grad_clip_norm=CLIP, **extra,
                         data_parallel=DataParallelConfig(zero_stage=zero_stage, zero=zero or ZeroOptions(),
                                                          grad_compression=compression, reshard_window=window,
                                                          reshard_gradients=reshard_gradients),
                         precision=PrecisionConfig(dtype=precision, loss_scale=LossScaleConfig(init_scale=2.0**20)))
    n = pp * copies
    parts = make_parts(n, 8, seed) if width == WIDTH else wide_parts(n, width, seed)
    return Pipeline(parts, mse, adamw, cfg, mesh=make_mesh(pp, dp))


def local_batch(pipe: Pipeline, step: int) -> tuple[Tensor, Tensor]:
    """This replica's share of step `step`'s batch (inputs as wide as the model)."""
    x, y = batch(step, BATCH)
    first = min(pipe.stage_state_modules)
    width = next(m for m in pipe.stage_state_modules[first].modules() if isinstance(m, nn.Linear)).in_features
    if width != WIDTH:
        x, y = x.repeat(1, width // WIDTH), y.repeat(1, width // WIDTH)
    rows = BATCH // pipe.groups.dp_size
    lo = pipe.groups.dp_rank * rows
    return x[lo:lo + rows], y[lo:lo + rows]


def train(pipe: Pipeline, applied: int, first: int = 0, limit: int = 30) -> list[float]:
    """Call step() on batches first, first+1, ... until `applied` optimizer steps happened (skips not counted)."""
    losses: list[float] = []
    target = pipe.optimizer_steps + applied
    while pipe.optimizer_steps < target and len(losses) < limit:
        losses.append(pipe.step(*local_batch(pipe, first + len(losses))))
    return losses


def full(t: Tensor) -> Tensor:
    """The whole tensor (a DTensor is gathered: collective over its mesh)."""
    gather = getattr(t, "full_tensor", None)
    return (gather() if gather is not None else t).detach()


def digests(pipe: Pipeline) -> dict[int, str]:
    """A hash of every stage's parameters, bit for bit."""
    out = {}
    for stage, module in sorted(pipe.stage_state_modules.items()):
        h = hashlib.sha256()
        for p in module.parameters():
            h.update(full(p).contiguous().view(torch.uint8).numpy().tobytes())
        out[stage] = h.hexdigest()[:16]
    return out


def flat_params(pipe: Pipeline) -> list[float]:
    """Every stage's parameters, whole, as one list (for comparisons within a tolerance)."""
    return torch.cat([full(p).reshape(-1) for _, m in sorted(pipe.stage_state_modules.items())
                      for p in m.parameters()]).tolist()


def max_rel(a: list[float], b: list[float]) -> float:
    """Largest |a - b| / max|b| over two lists of equal length."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((x - y).abs().max() / y.abs().max())


def equality_case(schedule: str, precision: str) -> dict[int, dict[str, Any]]:
    """zero_stage 0, 1, 2 at PP=2 x DP=2: 5 applied AdamW steps with clipping (fp16: with a skipped step)."""
    out = {}
    for stage in (0, 1, 2):
        pipe = build(schedule, stage, 2, precision=precision)
        losses = train(pipe, 5)
        out[stage] = {"digests": digests(pipe), "losses": losses, "skipped": pipe.scaler.skipped_steps,
                      "bytes": held_bytes(pipe), "wire": pipe.last.wire_bytes if pipe.last else 0.0,
                      "flats": [(f.layout.total, f.layout.padded) for f in pipe.dp.sharded.flats] if stage == 1
                      else []}
    return out


def accumulation_case(schedule: str) -> dict[int, dict[str, Any]]:
    """zero_stage 0, 1, 2 with two calls per optimizer step and activation checkpointing on."""
    out = {}
    for stage in (0, 1, 2):
        pipe = build(schedule, stage, 2, accumulation_steps=2, activation_checkpointing=True)
        losses = [pipe.step(*local_batch(pipe, call)) for call in range(6)]
        out[stage] = {"digests": digests(pipe), "losses": losses, "steps": pipe.optimizer_steps}
    return out


def quantized_case(stage: int) -> dict[str, Any]:
    """ZeRO-1/2 with qgZ + qwZ, and with bf16 reduce-scatter, beside the exact run: bytes per step, losses,
    and whether the data-parallel replicas hold identical weights."""
    out: dict[str, Any] = {}
    both = ZeroOptions(quantized_gradients=True, quantized_weights=True)
    for name, zero, compression in (("exact", None, None), ("int8", both, None), ("bf16", None, "bf16"),
                                    ("int8_by_name", ZeroOptions(quantized_weights=True), "int8")):
        pipe = build("1f1b", stage, 2, zero=zero, compression=compression, width=64)
        losses = train(pipe, 6)
        mine = digests(pipe)
        peer = [None] * dist.get_world_size()
        dist.all_gather_object(peer, mine)
        out[name] = {"losses": losses, "wire": pipe.last.wire_bytes if pipe.last else 0.0,
                     "replicas_equal": peer[dist.get_rank() ^ 1] == mine,
                     "unsegmented": pipe.dp.comms.unsegmented if stage == 2 else 0}
    return out


def resume_case(root: str, schedule: str, stage: int, zero: ZeroOptions | None = None) -> dict[str, Any]:
    """Save after 3 steps, train 3 more; a new pipeline (other weights) loads and trains the same 3."""
    path = str(Path(root) / f"{schedule}-zero{stage}{'-q' if zero else ''}")
    first = build(schedule, stage, 2, zero=zero)
    train(first, 3)
    first.save(path)
    straight = train(first, 3, first=3)
    resumed = build(schedule, stage, 2, seed=1, zero=zero)
    resumed.load(path)
    tail = train(resumed, 3, first=3)
    return {"straight": straight, "resumed": tail, "digests_equal": digests(first) == digests(resumed)}


def reshard_case(root: str) -> dict[str, Any]:
    """At PP=2 x DP=1 (zero_stage 0): continue from the DP=2 checkpoints of zero_stage 0, 1 and 2."""
    out = {}
    for stage in (0, 1, 2):
        pipe = build("1f1b", 0, 1, seed=1)
        pipe.load(str(Path(root) / f"1f1b-zero{stage}"))
        out[stage] = {"losses": train(pipe, 3, first=3), "calls": pipe.calls}
    return out


def quantized_options() -> ZeroOptions:
    """qgZ with stochastic rounding and qwZ (for the draw-counter resume case)."""
    return ZeroOptions(quantized_gradients=Int8Options(stochastic=True), quantized_weights=True)
