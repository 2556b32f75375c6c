"""Compiled pipelines against one process: a small token model (embedding, Block layers, head) in float64 trained 3
AdamW steps by a Pipeline whose blocks are compiled (by PipelineConfig.compile or by the user) and by plain
eager PyTorch in one process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from models import DIM, VOCAB, Block, Head, loss_fn, make_batch
from torch import nn

from duplexpipe import Pipeline, PipelineConfig
from duplexpipe.model.split import build_parts, plan_partition

LAYERS_PER_RANK, ROWS, STEPS = 2, 16, 3
"""Blocks per pipeline rank (one per part of the two-part schedules), rows per step, AdamW steps."""
PARTS = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "zb-h2": 1, "dualpipe": 1, "interleaved-1f1b": 2, "zbv": 2,
         "dualpipev": 2}
"""Model parts per pipeline rank of each schedule."""


@dataclass(frozen=True)
class Case:
    """One compiled pipeline: `who` compiles ("config": PipelineConfig.compile; "layers": the user compiled each
    layer; "parts": the user compiled each whole part) with torch.compile options `options`."""

    schedule: str
    who: str = "config"
    options: dict[str, Any] = field(default_factory=dict)
    checkpointing: bool = False
    rows: tuple[int, ...] = (ROWS,) * STEPS
    """The batch size of each step."""


def model(world: int, seed: int = 0) -> tuple[nn.Module, list[nn.Module], nn.Module]:
    """(embedding, layers, head) in float64 for `world` pipeline ranks."""
    torch.manual_seed(seed)
    embedding = nn.Embedding(VOCAB, DIM).double()
    return embedding, [Block(DIM).double() for _ in range(LAYERS_PER_RANK * world)], Head(DIM, VOCAB).double()


def reference(case: Case, world: int) -> list[float]:
    """The case's losses trained by one process, eager: whole batches, AdamW."""
    embedding, layers, head = model(world)
    net = nn.Sequential(embedding, *layers, head)
    optimizer = adamw(list(net.parameters()))
    losses = []
    for step, rows in enumerate(case.rows):
        optimizer.zero_grad()
        loss = loss_fn(net(make_batch(rows, step)[0]), make_batch(rows, step)[1])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of both sides."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def pipeline(case: Case, world: int) -> Pipeline:
    """The case's Pipeline on `world` ranks."""
    embedding, layers, head = model(world)
    config = PipelineConfig(schedule=case.schedule, num_microbatches=2 * world,  # DualPipe's least
                            activation_checkpointing=case.checkpointing,
                            compile=dict(case.options) if case.who == "config" else False)
    if case.who == "layers":
        layers = [torch.compile(layer, **case.options) for layer in layers]
    if case.who != "parts":
        return Pipeline.from_layers(layers, loss_fn, adamw, config, embedding=embedding, head=head)
    partition = plan_partition(layers, PARTS[case.schedule] * world, embedding=embedding, head=head)
    parts = build_parts(layers, partition, embedding=embedding, head=head)
    return Pipeline([torch.compile(p, **case.options) for p in parts], loss_fn, adamw, config)


def run(case: Case, world: int) -> dict[str, Any]:
    """Train the case; its largest relative loss error against the reference, and how much compiled where."""
    from torch._dynamo.utils import counters

    pipe = pipeline(case, world)
    before = counters["stats"]["unique_graphs"]
    losses = [pipe.step(*make_batch(rows, step)) for step, rows in enumerate(case.rows)]
    want = reference(case, world)
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)),
            "compiled": pipe.compiled.modules, "user": pipe.compiled.user,
            "graphs": counters["stats"]["unique_graphs"] - before}
