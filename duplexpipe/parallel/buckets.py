"""Fixed gradient buckets for the data-parallel reduction: by bytes, in the order gradients become final."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from duplexpipe.comm.local_tensors import local_of


@dataclass(frozen=True, eq=False)
class BucketSpec:
    """One bucket: a fixed run of parameters of one dtype and device, reduced together."""

    index: int
    """Position in the plan (0 is reduced first); stable from step to step (compressors key state by it)."""
    params: tuple[nn.Parameter, ...]
    """The parameters whose gradients it holds, in the order their gradients become final."""
    stages: frozenset[int]
    """The stages those parameters belong to: the bucket is ready once all their gradients are final."""

    @property
    def numel(self) -> int:
        """Elements of all its gradients (of a DTensor parameter, its local shard's)."""
        return sum(local_of(p).numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        """Bytes of all its gradients (local shards)."""
        return sum(local_of(p).numel() * p.element_size() for p in self.params)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The shapes of its gradients (local shards), in order."""
        return [tuple(local_of(p).shape) for p in self.params]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its gradients share."""
        return self.params[0].dtype


def final_order(grads_final: Mapping[int, Sequence[int]], mirrored: Sequence[int]) -> list[int]:
    """This rank's stages in the order their gradients become final in a step: by the position of their
    last B or W in the rank's list (`RankPlan.grads_final`), then the `mirrored` ones (after the mirror sum)."""
    return [s for pos in sorted(grads_final) for s in grads_final[pos]] + list(mirrored)


def plan_buckets(stage_params: Sequence[tuple[int, Sequence[nn.Parameter]]], bucket_bytes: int) -> list[BucketSpec]:
    """Buckets of at most `bucket_bytes` (one larger parameter alone) over the trainable parameters.

    `stage_params` lists (stage, its parameters) in the order the stages' gradients become final; within a
    stage the parameters are taken in reverse (the backward produces the last layer's gradients first).
    Consecutive parameters share a bucket while they fit and have the same dtype and device; a bucket may
    span a stage boundary (it is then ready when the later stage is).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    runs: list[tuple[list[nn.Parameter], set[int]]] = []
    size = 0
    for stage, params in stage_params:
        for p in reversed([p for p in params if p.requires_grad]):
            nbytes = local_of(p).numel() * p.element_size()
            last = runs[-1][0] if runs else None
            if last is None or last[0].dtype != p.dtype or last[0].device != p.device or size + nbytes > bucket_bytes:
                runs.append(([p], {stage}))
                size = nbytes
            else:
                last.append(p)
                runs[-1][1].add(stage)
                size += nbytes
    return [BucketSpec(i, tuple(ps), frozenset(stages)) for i, (ps, stages) in enumerate(runs)]


class BucketTracker:
    """Which buckets become ready as stages' gradients become final, step after step."""

    def __init__(self, specs: Sequence[BucketSpec]) -> None:
        self.specs = list(specs)
        self._waiting: dict[int, set[int]] = {}
        self.begin()

    def begin(self) -> None:
        """A new step: every bucket waits for all of its stages again."""
        self._waiting = {spec.index: set(spec.stages) for spec in self.specs}

    def ready(self, stage: int) -> list[BucketSpec]:
        """Mark `stage` final; return the buckets that became ready (in index order)."""
        out = []
        for spec in self.specs:
            waiting = self._waiting.get(spec.index)
            if waiting is not None and stage in waiting:
                waiting.discard(stage)
                if not waiting:
                    del self._waiting[spec.index]
                    out.append(spec)
        return out

    def pending(self) -> list[BucketSpec]:
        """Buckets not ready yet (in index order)."""
        return [spec for spec in self.specs if spec.index in self._waiting]
