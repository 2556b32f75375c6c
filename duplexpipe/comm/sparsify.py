"""Sparsifiers with a fixed number of slots k per bucket (static shapes): top-k (over the bucket or per
tensor), random-k and threshold."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Selection:
    """What one rank transmits from a flat tensor x: k (value, index) slots."""

    values: Tensor
    """k values: x[indices] where the slot is used, 0 in unused slots."""
    indices: Tensor
    """k int64 positions into x (unused slots point at 0 and carry value 0, so adding them is harmless)."""
    chosen: Tensor
    """The positions actually transmitted (the used slots' indices): the error feedback zeroes these."""


def keep_count(numel: int, ratio: float) -> int:
    """Slots for a tensor of `numel` elements keeping fraction `ratio` in (0, 1]: round(numel * ratio),
    at least 1 and at most numel. Every rank computes the same k for the same bucket."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if numel < 1:
        raise ValueError(f"cannot sparsify an empty tensor (numel {numel})")
    return max(1, min(numel, int(numel * ratio + 0.5)))


def _check(x: Tensor, k: int) -> None:
    if x.dim() != 1:
        raise ValueError(f"expected a flat (1-D) tensor, got shape {tuple(x.shape)}")
    if not 1 <= k <= x.numel():
        raise ValueError(f"k must be in [1, {x.numel()}], got {k}")


def largest(magnitude: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of a flat non-negative tensor (exact, in no particular order).

    For k much smaller than numel, a strided sample's quantile gives a threshold that about 2k entries
    pass (as DGC's sampled threshold does); the top k among those are the top k overall whenever at least
    k pass, else the full top-k runs.
    """
    numel = magnitude.numel()
    if 50 * k <= numel:
        stride = max(1, k // 100)  # about 100 * numel / k samples: some 100 above the k-th largest
        sample = magnitude[::stride]
        want = min(sample.numel(), 2 * -(-k // stride))
        cut = torch.topk(sample, want, sorted=False).values.min()
        candidates = torch.nonzero(magnitude >= cut).view(-1)
        if candidates.numel() >= k:
            return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]
    return torch.topk(magnitude, k, sorted=False).indices


def top_k(x: Tensor, k: int) -> Selection:
    """The k entries of largest magnitude."""
    _check(x, k)
    indices = largest(x.abs(), k)
    return Selection(x[indices], indices, indices)


def segment_keep_counts(numels: Sequence[int], ratio: float) -> list[int]:
    """Slots per segment (tensor) of a bucket: keep_count(numel_i, ratio) each, so every tensor, however
    small, gets at least one; 0 for an empty tensor. Every rank computes the same counts for the same bucket."""
    return [keep_count(n, ratio) if n > 0 else 0 for n in numels]


def top_k_segments(x: Tensor, numels: Sequence[int], ks: Sequence[int]) -> Selection:
    """The ks[i] entries of largest magnitude within each consecutive segment i of x (numels[i] entries):
    each tensor against its own threshold, as DGC selects per layer, so a tensor whose gradients are 1000x
    smaller than its neighbours' still gets its slots. sum(ks) slots; indices point into the flat x."""
    if x.dim() != 1:
        raise ValueError(f"expected a flat (1-D) tensor, got shape {tuple(x.shape)}")
    if len(numels) != len(ks) or sum(numels) != x.numel():
        raise ValueError(f"segments {list(numels)} with slot counts {list(ks)} do not cover {x.numel()} entries")
    magnitude, parts, offset = x.abs(), [], 0
    for numel, k in zip(numels, ks, strict=True):
        if not 0 <= k <= numel:
            raise ValueError(f"k must be in [0, {numel}] for a segment of {numel} entries, got {k}")
        if k > 0:
            parts.append(largest(magnitude[offset:offset + numel], k) + offset)
        offset += numel
    if not parts:
        raise ValueError("every segment has 0 slots: nothing to transmit")
    indices = torch.cat(parts)
    return Selection(x[indices], indices, indices)


def random_k(x: Tensor, k: int, generator: torch.Generator) -> Selection:
    """One entry drawn uniformly from each of k equal strata of x (strata sizes differ by at most one):
    k distinct entries, each entry chosen with probability about k / numel, in O(k). Not rescaled: error
    feedback keeps the rest."""
    _check(x, k)
    starts = torch.arange(k + 1, device=x.device) * x.numel() // k
    sizes = starts[1:] - starts[:-1]
    offsets = (torch.rand(k, generator=generator, dtype=torch.float64, device=x.device) * sizes).long()
    indices = starts[:-1] + torch.minimum(offsets, sizes - 1)
    return Selection(x[indices], indices, indices)


def threshold(x: Tensor, k: int, theta: float) -> Selection:
    """The entries with |x| >= theta * max|x| (the seeds' rule; it is not DGC), at most k of them
    (the largest): a fixed capacity of k slots, so the bytes on the wire do not depend on theta."""
    _check(x, k)
    if not 0.0 <= theta <= 1.0:
        raise ValueError(f"theta must be in [0, 1], got {theta}")
    magnitude = x.abs()
    top = largest(magnitude, k)
    used = magnitude[top] >= theta * magnitude.max()
    indices = torch.where(used, top, torch.zeros_like(top))
    values = torch.where(used, x[top], torch.zeros_like(x[top]))
    return Selection(values, indices, top[used])
