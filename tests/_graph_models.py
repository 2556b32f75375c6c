"""Models for the graph-split tests: a residual that spans the cuts and a forward taking (x, mask)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

DIM, OUT = 8, 3


class MaskedBlock(nn.Module):
    """tanh(W LN(x)) with masked-out rows set to zero."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return torch.tanh(self.lin(self.norm(x))) * mask


class SkipNet(nn.Module):
    """inp -> 4 residual blocks (each sees the mask) -> out(h + skip), where `skip` is inp's output:
    a residual that spans every cut between the blocks."""

    def __init__(self, dim: int = DIM, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([MaskedBlock(dim) for _ in range(blocks)])
        self.out = nn.Linear(dim, OUT)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.inp(x)
        skip = h
        for layer in self.layers:
            h = h + layer(h, mask)
        return self.out(h + skip)


def sample(rows: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(x, mask, target) for `rows` samples; the mask is float 0/1 of shape (rows, 1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, DIM, generator=gen)
    mask = (torch.rand(rows, 1, generator=gen) > 0.25).float()
    return x, mask, torch.randn(rows, OUT, generator=gen)
