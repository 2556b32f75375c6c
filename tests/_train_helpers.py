"""Shared helpers for the pipeline tests: a small model, deterministic data and a single-process reference."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from duplexpipe.model.split import split_model

WIDTH = 8


def make_parts(num_parts: int, num_blocks: int = 8, seed: int = 0) -> list[nn.Sequential]:
    """`num_blocks` Linear+Tanh blocks split uniformly into `num_parts` parts, from `seed`."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_blocks)]
    return split_model(blocks, num_parts)[0]


def batch(step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of `step` (the same on every rank)."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(size, WIDTH, generator=gen)
    return x, torch.sin(2 * x).roll(1, dims=1)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer every case uses."""
    return torch.optim.Adam(params, lr=1e-2)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error (the mean over the microbatch)."""
    return nn.functional.mse_loss(out.float(), target)


class Reference:
    """The same parts trained in one process, the plain PyTorch way."""

    def __init__(self, parts: Sequence[nn.Module], clip: float | None = None,
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = adam) -> None:
        self.parts = [copy.deepcopy(p) for p in parts]
        self.model = nn.Sequential(*self.parts)
        self.clip = clip
        self.optimizer = optimizer(list(self.model.parameters()))

    def step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """One optimizer step over `batches` (an accumulation window): grad of the mean over all samples."""
        self.optimizer.zero_grad()
        total = sum(x.shape[0] for x, _ in batches)
        losses = []
        for x, y in batches:
            loss = mse(self.model(x), y)
            (loss * (x.shape[0] / total)).backward()
            losses.append(loss.item())
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        return losses


def max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest |a-b| / |b| over the pairs."""
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def max_param_diff(pipe_modules: dict[int, nn.Module], groups: dict[int, int], ref: Reference) -> float:
    """Largest absolute difference between this rank's stage weights and the reference's parts."""
    worst = 0.0
    for stage, module in pipe_modules.items():
        ref_part = ref.parts[groups[stage]]
        for a, b in zip(module.parameters(), ref_part.parameters(), strict=True):
            worst = max(worst, (a.detach() - b.detach()).abs().max().item())
    return worst
