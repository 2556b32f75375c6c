"""Cases for tests/parallel/test_strategies.py: data-parallel strategies in training, one launch of 4 gloo ranks."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from _train_helpers import Reference, adam, batch, make_parts, max_param_diff, max_rel_diff, mse
from torch import nn

from duplexpipe.dp_options.compression import (
    DGCOptions,
    Int8Options,
    Options,
    PowerSGDOptions,
    RandomKOptions,
    ThresholdOptions,
    TopKOptions,
)
from duplexpipe.parallel.mesh import make_mesh
from duplexpipe.runtime import gather_timeline
from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.registry import build as build_schedule
from duplexpipe.train.pipeline_config import DataParallelConfig, PrecisionConfig
from duplexpipe.train.precision import LossScaleConfig
from duplexpipe.train.trainer import Pipeline, PipelineConfig

SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv", "dualpipe", "dualpipev")
"""Schedules run at PP=2 x DP=2 (DualPipe's mirror sum comes before the data-parallel reduction)."""
LOSSLESS = TopKOptions(ratio=1.0)
"""Top-k keeping every entry: the compressed path with nothing lost (sum over 2 ranks is exact)."""
LOSSY: dict[str, Options | str] = {
    "bf16": "bf16", "int8": Int8Options(block=16), "powersgd": PowerSGDOptions(rank=1, start_step=2),
    "topk": TopKOptions(ratio=0.25), "randomk": RandomKOptions(ratio=0.25),
    "threshold": ThresholdOptions(ratio=0.25, theta=0.1), "dgc": DGCOptions(ratio=0.25, warmup_steps=1, clip_norm=1.0),
}
"""Lossy methods trained for a few steps (DGC with SGD without momentum, the others with SGD + momentum)."""
ROWS = 16
MICROBATCHES = 4


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum (sparsifiers assume SGD)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def plain_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD without momentum (DGC applies the momentum in its compressor)."""
    return torch.optim.SGD(params, lr=0.05)


def _parts_for(schedule: str, options: dict[str, Any]) -> list[nn.Sequential]:
    return make_parts(build_schedule(schedule, 2, MICROBATCHES, **options).num_groups)


def _pipe(schedule: str, compression: Any, optimizer: Callable[..., Any] = sgd, bucket_bytes: int | None = None,
          **config: Any) -> Pipeline:
    options = {"chunks": 2} if schedule == "interleaved-1f1b" else {}
    dp = DataParallelConfig(grad_compression=compression)
    cfg = PipelineConfig(schedule, MICROBATCHES, schedule_options=options, **config,
                         data_parallel=dp if bucket_bytes is None else replace(dp, grad_bucket_bytes=bucket_bytes))
    return Pipeline(_parts_for(schedule, options), mse, optimizer, cfg, mesh=make_mesh(2, 2))


def _local(pipe: Pipeline, step: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step, rows)
    share = rows // pipe.groups.dp_size
    lo = pipe.groups.dp_rank * share
    return x[lo:lo + share], y[lo:lo + share]


def _groups(pipe: Pipeline) -> dict[int, int]:
    return {s: pipe.schedule.stages[s].group for s in pipe.stage_modules}


def _flat_params(pipe: Pipeline) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in pipe.params])


def equivalence(schedule: str, compression: Any, steps: int = 4) -> dict[str, Any]:
    """PP=2 x DP=2 against the single-process reference (whole batch, same SGD)."""
    options = {"chunks": 2} if schedule == "interleaved-1f1b" else {}
    pipe = _pipe(schedule, compression)
    ref = Reference(_parts_for(schedule, options), optimizer=sgd)
    losses, ref_losses, wire = [], [], []
    for step in range(steps):
        ref_losses += ref.step([batch(step, ROWS)])
        losses.append(pipe.step(*_local(pipe, step)))
        wire.append(pipe.last.wire_bytes if pipe.last else -1.0)
    trainable = sum(p.numel() * p.element_size() for p in pipe.params if p.requires_grad)
    return {"losses": losses, "loss_rel": max_rel_diff(losses, ref_losses),
            "param": max_param_diff(pipe.stage_modules, _groups(pipe), ref), "wire": wire,
            "fp32_ring_bytes": float(trainable), "strategy": pipe.dp.name, "params": _flat_params(pipe)}


def overlap() -> dict[str, Any]:
    """Interleaved 1F1B (two stages per rank), one bucket per parameter: what the DP lane shows."""
    pipe = _pipe("interleaved-1f1b", None, bucket_bytes=1)
    for step in range(2):
        pipe.step(*_local(pipe, step))
    assert pipe.last is not None and pipe.last.timeline is not None
    mine = pipe.last.timeline
    merged = gather_timeline(mine, group=pipe.groups.pp_group)
    bucket_spans = [s for s in mine.spans if s.lane == "dp" and s.name.startswith("bucket ")]
    first = min(bucket_spans, key=lambda s: s.start)
    later = [e for e in mine.events if e.start >= first.start]
    return {"buckets": len(pipe.dp.buckets), "bucket_spans": len(bucket_spans),
            "lanes": mine.lanes(), "waits": sum(s.name == "wait" for s in mine.spans),
            "exposed_spans": sorted(s.name for s in mine.spans if s.lane == "exposed" and s.name.startswith("bucket ")),
            "exposed_buckets": sorted(pipe.last.exposure.buckets) if pipe.last.exposure is not None else None,
            "compute_after_first_start": [str(e.action) for e in later],
            "backward_after_first_start": any(p.op in (Op.B, Op.I, Op.W) for e in later
                                              for p in e.action.compute_parts()),
            "merged_span_ranks": sorted({s.rank for s in merged.spans}),
            "ordered": all(s.start <= s.end for s in mine.spans)}


def lossy(name: str, steps: int = 6) -> dict[str, Any]:
    """A lossy method trains: finite losses, identical replicas, the bytes its meter counted."""
    optimizer = plain_sgd if name == "dgc" else sgd
    pipe = _pipe("1f1b", LOSSY[name], optimizer)
    losses, wire = [], []
    for step in range(steps):
        losses.append(pipe.step(*_local(pipe, step)))
        wire.append(pipe.last.wire_bytes if pipe.last else -1.0)
    return {"losses": losses, "wire": wire, "params": _flat_params(pipe), "method": pipe.dp.name}


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def fp16_skip(name: str, inf_step: int = 2) -> dict[str, Any]:
    """fp16 with an inf injected into one gradient on global rank 0 at `inf_step`: every rank skips that
    step and the compressor's residuals and state stay exactly as they were."""
    optimizer = plain_sgd if name == "dgc" else sgd
    pipe = _pipe("1f1b", LOSSY[name], optimizer,
                 precision=PrecisionConfig("fp16", loss_scale=LossScaleConfig(init_scale=2.0**8)))
    when = {"step": -1}
    if dist.get_rank() == 0:
        weight = next(pipe.stage_modules[0].parameters())
        weight.register_hook(lambda g: torch.full_like(g, math.inf) if when["step"] == inf_step else g)
    skipped, kept, changed = [], [], []
    for step in range(inf_step + 2):
        when["step"] = step
        before = pipe.dp.state_dict()
        pipe.step(*_local(pipe, step))
        skipped.append(pipe.last.skipped if pipe.last else None)
        same = _same_state(before, pipe.dp.state_dict())
        kept.append(same)
        changed.append(not same)
    return {"skipped": skipped, "state_kept": kept, "state_changed": changed}


def resume(name: str, path: str, steps: int = 3) -> dict[str, Any]:
    """Train, save, train on; a fresh pipeline loading the checkpoint repeats the second half exactly."""
    optimizer = plain_sgd if name == "dgc" else sgd
    first = _pipe("1f1b", LOSSY[name], optimizer)
    for step in range(steps):
        first.step(*_local(first, step))
    first.save(path)
    after = [first.step(*_local(first, step)) for step in range(steps, 2 * steps)]
    second = _pipe("1f1b", LOSSY[name], optimizer)
    second.load(path)
    again = [second.step(*_local(second, step)) for step in range(steps, 2 * steps)]
    return {"after": after, "again": again, "params_equal": bool(torch.equal(_flat_params(first),
                                                                             _flat_params(second)))}


def dp1() -> dict[str, Any]:
    """PP=4 without data parallelism: compression is a no-op, said in one warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = Pipeline(make_parts(4), mse, sgd, PipelineConfig("1f1b", MICROBATCHES,
                                                                data_parallel=DataParallelConfig(grad_compression="int8")))
        compressed = [pipe.step(*batch(step, ROWS)) for step in range(3)]
    plain = Pipeline(make_parts(4), mse, sgd, PipelineConfig("1f1b", MICROBATCHES))
    exact = [plain.step(*batch(step, ROWS)) for step in range(3)]
    messages = [str(w.message) for w in caught if "grad_compression" in str(w.message)]
    return {"messages": messages, "compressed": compressed, "exact": exact, "strategy": pipe.dp.name,
            "wire": pipe.last.wire_bytes if pipe.last else -1.0}


def accumulation() -> dict[str, Any]:
    """Two calls per optimizer step with unequal batches: the compressed path unscales by the window weight."""
    pipe = _pipe("1f1b", LOSSLESS, accumulation_steps=2, grad_clip_norm=0.3)
    ref = Reference(_parts_for("1f1b", {}), clip=0.3, optimizer=sgd)
    losses, ref_losses = [], []
    for step in range(4):
        window = [(2 * step, ROWS), (2 * step + 1, ROWS // 2)]
        ref_losses += ref.step([batch(s, rows) for s, rows in window])
        losses += [pipe.step(*_local(pipe, s, rows)) for s, rows in window]
    return {"loss_rel": max_rel_diff(losses, ref_losses),
            "param": max_param_diff(pipe.stage_modules, _groups(pipe), ref)}


def _replica_grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    """Each data-parallel replica's flat gradient of its half of the batch (the whole model's)."""
    x, y = batch(step, ROWS)
    out = []
    for half in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS)):
        model.zero_grad()
        mse(model(x[half]), y[half]).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return out


def dgc_local_clip(steps: int = 4, clip: float = 0.05) -> dict[str, Any]:
    """DGC keeping every entry without momentum, with local clipping: each replica's mean gradient, over the
    whole model (both pipeline stages), is clipped to clip * sqrt(2) (2 replicas) before averaging; against a
    single-process reference doing that, and against one clipping each stage by its own norm (which the test
    must tell apart)."""
    pipe = _pipe("1f1b", DGCOptions(ratio=1.0, momentum=0.0, clip_norm=clip), plain_sgd)
    ref = {kind: Reference(_parts_for("1f1b", {}), optimizer=plain_sgd) for kind in ("replica", "stage")}
    sizes = [sum(p.numel() for p in part.parameters()) for part in ref["replica"].parts]
    norms = []
    for step in range(steps):
        pipe.step(*_local(pipe, step))
        for kind, r in ref.items():
            parts = _replica_grads(r.model, step)
            norms += [float(g.norm()) for g in parts]
            pieces = [[g] if kind == "replica" else list(g.split(sizes)) for g in parts]
            clipped = [torch.cat([q * min(1.0, clip * math.sqrt(2) / (float(q.norm()) + 1e-12)) for q in qs])
                       for qs in pieces]
            mean = (clipped[0] + clipped[1]) / 2
            torch.nn.utils.vector_to_parameters(mean, [p.grad for p in r.model.parameters()])
            r.optimizer.step()
    return {"replica": max_param_diff(pipe.stage_modules, _groups(pipe), ref["replica"]),
            "stage": max_param_diff(pipe.stage_modules, _groups(pipe), ref["stage"]),
            "min_norm": min(norms), "clip": clip * math.sqrt(2)}


def bad_optimizers() -> dict[str, str]:
    """Sparsifiers under Adam, DGC under SGD with momentum: ValueError on every rank, naming the value."""
    out = {}
    for label, compression, optimizer in (("topk_adam", "topk", adam), ("dgc_momentum", "dgc", sgd)):
        try:
            _pipe("1f1b", compression, optimizer)
            out[label] = ""
        except ValueError as exc:
            out[label] = str(exc)
    return out


def all_cases(path: str) -> dict[str, Any]:
    """Every case on this rank (4 ranks: PP=2 x DP=2 unless the case says otherwise)."""
    torch.manual_seed(0)
    out: dict[str, Any] = {"coords": None}
    for schedule in SCHEDULES:
        out[f"replicated/{schedule}"] = equivalence(schedule, None)
        out[f"lossless/{schedule}"] = equivalence(schedule, LOSSLESS)
    out["overlap"] = overlap()
    out["accumulation"] = accumulation()
    out["dgc_local_clip"] = dgc_local_clip()
    for name in LOSSY:
        out[f"lossy/{name}"] = lossy(name)
    for name in ("int8", "dgc"):
        out[f"fp16/{name}"] = fp16_skip(name)
    for name in ("int8", "powersgd", "dgc"):
        out[f"resume/{name}"] = resume(name, os.path.join(path, name))
    out["dp1"] = dp1()
    out["bad"] = bad_optimizers()
    out["coords"] = (dist.get_rank() // 2, dist.get_rank() % 2)
    return out
