"""A flat gradient bucket with the GradBucket interface that torch's DDP communication hooks call."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


class Bucket:
    """A flat 1-D buffer holding several gradients, each a view into it, under a stable index.

    torch's DDP hooks (bf16/fp16 compression, PowerSGD) call only buffer(), gradients(), index(),
    is_last() and set_buffer(); PowerSGD keys its error feedback and warm start by index(), so a
    bucket must keep its index (and its shapes) from step to step. Reducers write the averaged
    gradients into the buffer, so gradients() then read the result.
    """

    def __init__(self, index: int, shapes: Sequence[Sequence[int]], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, last: bool = False) -> None:
        if index < 0:
            raise ValueError(f"bucket index must be >= 0, got {index}")
        if not shapes:
            raise ValueError(f"bucket {index} needs at least one gradient shape")
        if not dtype.is_floating_point:
            raise ValueError(f"bucket {index}: gradients must be floating point, got {dtype}")
        self._index = index
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self._buffer = torch.zeros(sum(self.numels), dtype=dtype, device=device)
        self.last = last
        """What is_last() answers (torch's meaning: the last bucket reduced in a step)."""

    @classmethod
    def of(cls, index: int, tensors: Sequence[Tensor], *, last: bool = False) -> Bucket:
        """A bucket shaped like `tensors` (same dtype and device), holding a copy of them."""
        if not tensors:
            raise ValueError(f"bucket {index} needs at least one tensor")
        first = tensors[0]
        bucket = cls(index, [t.shape for t in tensors], dtype=first.dtype, device=first.device, last=last)
        bucket.load(tensors)
        return bucket

    def index(self) -> int:
        """The bucket's stable index."""
        return self._index

    def buffer(self) -> Tensor:
        """The flat buffer."""
        return self._buffer

    def set_buffer(self, tensor: Tensor) -> None:
        """Replace the flat buffer (hooks that change its dtype do this); gradients() follow it."""
        if tensor.shape != self._buffer.shape:
            raise ValueError(f"bucket {self._index}: new buffer has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(self._buffer.shape)}")
        self._buffer = tensor

    def gradients(self) -> list[Tensor]:
        """One view into the buffer per gradient, in order (a 0-d gradient appears with shape (1,),
        since PowerSGD views every gradient as a matrix of shape[0] rows)."""
        views, offset = [], 0
        for shape, numel in zip(self.shapes, self.numels, strict=True):
            view = self._buffer[offset:offset + numel]
            views.append(view.view(shape) if len(shape) > 0 else view)
            offset += numel
        return views

    def is_last(self) -> bool:
        """The `last` flag (reducers here do not depend on it; PowerSGD's reducer counts steps itself)."""
        return self.last

    def load(self, tensors: Sequence[Tensor]) -> None:
        """Copy `tensors` (shaped like the bucket's gradients) into the buffer."""
        self._check(tensors)
        for view, t in zip(self.gradients(), tensors, strict=True):
            view.copy_(t.reshape(view.shape))

    def store(self, tensors: Sequence[Tensor]) -> None:
        """Copy the buffer's gradients out into `tensors`."""
        self._check(tensors)
        for view, t in zip(self.gradients(), tensors, strict=True):
            t.copy_(view.reshape(t.shape))

    def _check(self, tensors: Sequence[Tensor]) -> None:
        got = [tuple(t.shape) for t in tensors]
        if got != [tuple(s) for s in self.shapes]:
            raise ValueError(f"bucket {self._index} holds shapes {[tuple(s) for s in self.shapes]}, got {got}")
