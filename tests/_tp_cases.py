"""A small GPT (the bundled task's blocks: attention + MLP) in float64 and its one-process reference, for the
tensor-parallel tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from duplexpipe import Pipeline, PipelineConfig, make_mesh
from duplexpipe.launch.tasks.gpt import GPTConfig, build_gpt, gpt_tp_plan

VOCAB, SEQ, ROWS, STEPS, CLIP = 16, 8, 8, 3, 0.05
"""Vocabulary, sequence length, rows per step (over all replicas), AdamW steps, clipping (active: the norm counts)."""
CONFIG = GPTConfig(vocab_size=VOCAB, block_size=SEQ, d_model=16, n_head=4, n_layer=4)


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Token cross entropy in the logits' dtype (float64: the bundled lm_loss computes in float32)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The tests' optimizer."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def gpt(tied: bool = False, **changes: Any) -> tuple[nn.Module, list[nn.Module], nn.Module]:
    """(embedding, blocks, head) in float64, `changes` to CONFIG's fields; `tied`: a plain embedding and a
    bias-free head sharing its weight."""
    cfg = replace(CONFIG, **changes)
    embedding, blocks, head = build_gpt(cfg, seed=0)
    if tied:
        torch.manual_seed(3)
        embedding = nn.Embedding(VOCAB, cfg.d_model)
        head = nn.Linear(cfg.d_model, VOCAB, bias=False)
        head.weight = embedding.weight
    return embedding.double(), [b.double() for b in blocks], head.double()


def batch(step: int) -> tuple[Tensor, Tensor]:
    """The global batch of `step` (every replica takes its rows)."""
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen), torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen))


def rows(value: Tensor, replica: int, replicas: int) -> Tensor:
    """Replica `replica`'s rows of a global batch."""
    size = value.shape[0] // replicas
    return value[replica * size:(replica + 1) * size]


def pipeline(mesh_shape: tuple[int, int, int], config: PipelineConfig, *, tied: bool = False,
             plan: Any = None) -> Pipeline:
    """The GPT on a make_mesh(pp, dp, tp=tp) mesh with the bundled plan (SP as the config says)."""
    pp, dp, tp = mesh_shape
    embedding, blocks, head = gpt(tied)
    if plan is None and tp > 1:
        plan = gpt_tp_plan(config.sequence_parallel)
    return Pipeline.from_layers(blocks, loss_fn, adamw, config, embedding=embedding, head=head,
                                mesh=make_mesh(pp, dp, tp=tp), tp_plan=plan)


def train(pipe: Pipeline, steps: Sequence[int]) -> list[float]:
    """The pipeline's losses over `steps`, each replica on its rows."""
    groups = pipe.groups
    return [pipe.step(*(rows(t, groups.dp_rank, groups.dp_size) for t in batch(s))) for s in steps]


class Reference:
    """The whole model in one process, trained the plain PyTorch way (clipping as the pipelines clip)."""

    def __init__(self, tied: bool = False, clip: float | None = CLIP) -> None:
        embedding, blocks, head = gpt(tied)
        self.model = nn.Sequential(embedding, *blocks, head)
        self.optimizer = adamw(list(self.model.parameters()))
        self.clip = clip

    def train(self, steps: Sequence[int]) -> list[float]:
        """Losses of `steps` optimizer steps on the global batches."""
        out = []
        for s in steps:
            x, y = batch(s)
            self.optimizer.zero_grad()
            loss = loss_fn(self.model(x), y)
            loss.backward()
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
            out.append(loss.item())
        return out


def max_rel(got: Sequence[float], want: Sequence[float]) -> float:
    """Largest |got - want| / |want|."""
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
