"""Models whose stages pass several tensors: (hidden, mask) tuples and dicts, with a single-process reference."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from models import DIM, SEQ, VOCAB, Block
from torch import Tensor, nn


class MaskedPart(nn.Module):
    """Takes (tokens or hidden, mask) and returns (hidden, mask); the last part returns (logits, mask).

    The int mask flows forward only and changes the result: masked positions skip the block.
    """

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.block = Block(DIM)
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        h = self.embed(x) if self.embed is not None else x
        keep = mask.unsqueeze(-1).to(h.dtype)
        h = h + (self.block(h) - h) * keep
        return (self.head(h) if self.head is not None else h), mask


def masked_loss(out: tuple[Tensor, Tensor], targets: Tensor) -> Tensor:
    """Mean over rows of each row's cross entropy averaged over its unmasked tokens."""
    logits, mask = out
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    per_token = per_token.view(targets.shape) * mask
    return (per_token.sum(1) / mask.sum(1).clamp(min=1)).mean()


class DictPart(nn.Module):
    """Takes tokens (first part) or keyword tensors a, b, aux, scale and returns a dict.

    a and b carry gradients; aux carries one but the next part ignores it (its gradient is
    zero); scale is a float computed under no_grad (flows forward only); the last part returns
    the logits tensor.
    """

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 2 * DIM) if first else None
        self.mix = nn.Linear(2 * DIM, 2 * DIM)
        self.aux = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, tokens: Tensor | None = None, a: Tensor | None = None, b: Tensor | None = None,
                aux: Tensor | None = None, scale: Tensor | None = None) -> Any:
        if self.embed is not None:
            assert tokens is not None
            both = self.embed(tokens)
            with torch.no_grad():
                scale = 1.0 + (tokens % 3).to(both.dtype).unsqueeze(-1)
        else:
            assert a is not None and b is not None and scale is not None
            both = torch.cat([a, b], dim=-1)
        mixed = torch.tanh(self.mix(both)) * scale
        residual = a if a is not None else 0.0
        a, b = mixed[..., :DIM], mixed[..., DIM:] + residual
        if self.head is not None:
            return self.head(a * b)
        return {"a": a, "b": b, "aux": self.aux(a), "scale": scale}


def dict_loss(logits: Tensor, targets: dict[str, Tensor]) -> Tensor:
    """Cross entropy weighted per token by targets["w"] (a float), mean over every token."""
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), targets["y"].reshape(-1), reduction="none")
    return (per_token * targets["w"].reshape(-1)).mean()


KINDS = ("masked", "dict")


def make_message_parts(kind: str, num_parts: int, seed: int, dtype: torch.dtype = torch.float64) -> list[nn.Module]:
    """The model of `kind` as `num_parts` parts from `seed`."""
    torch.manual_seed(seed)
    cls = MaskedPart if kind == "masked" else DictPart
    return [cls(k == 0, k == num_parts - 1).to(dtype) for k in range(num_parts)]


def message_batch(kind: str, rows: int, seed: int, dtype: torch.dtype = torch.float64) -> tuple[Any, Any]:
    """(inputs, targets): ((tokens, mask), targets) for "masked", (tokens, {"y", "w"}) for "dict"."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    if kind == "masked":
        mask = (torch.rand(rows, SEQ, generator=gen) < 0.6).long()
        mask[:, 0] = 1
        return (tokens, mask), targets
    return tokens, {"y": targets, "w": torch.rand(rows, SEQ, generator=gen, dtype=dtype)}


def message_loss(kind: str) -> Any:
    """The loss function of `kind`."""
    return masked_loss if kind == "masked" else dict_loss


def _apply(part: nn.Module, x: Any) -> Any:
    if isinstance(x, dict):
        return part(**x)
    if isinstance(x, (tuple, list)):
        return part(*x)
    return part(x)


def message_reference(kind: str, parts: Sequence[nn.Module], batches: Sequence[tuple[Any, Any]]
                      ) -> tuple[list[float], list[list[Tensor]], Any]:
    """One process, whole batches: losses, gradients summed over the batches, the last batch's output."""
    model = [copy.deepcopy(p) for p in parts]
    losses, out = [], None
    for inputs, targets in batches:
        out = inputs
        for part in model:
            out = _apply(part, out)
        loss = message_loss(kind)(out, targets)
        loss.backward()
        losses.append(loss.item())
    grads = [[p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in part.parameters()]
             for part in model]
    return losses, grads, out
