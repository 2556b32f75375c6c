"""Error feedback: per-bucket residuals carried exactly from step to step, committed or rolled back per step."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class StagedState:
    """Tensors keyed by bucket index whose new values, staged during a step, replace the old ones only at
    commit(); rollback() drops them (a skipped step leaves the state untouched)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._committed: dict[int, Tensor] = {}
        self._staged: dict[int, Tensor] = {}

    def get(self, index: int) -> Tensor | None:
        """The committed tensor of bucket `index` (None before its first committed step)."""
        return self._committed.get(index)

    def staged(self, index: int) -> Tensor | None:
        """The value staged for bucket `index` in the open step, if any."""
        return self._staged.get(index)

    def stage(self, index: int, value: Tensor) -> None:
        """Set bucket `index`'s value for when the step commits (`value` must not alias a committed tensor)."""
        self._staged[index] = value

    def take(self, index: int) -> Tensor | None:
        """Remove and return bucket `index`'s committed tensor (None if it has none)."""
        return self._committed.pop(index, None)

    def commit(self) -> None:
        """Make the staged values current."""
        self._committed.update(self._staged)
        self._staged.clear()

    def rollback(self) -> None:
        """Forget the staged values."""
        self._staged.clear()

    def state_dict(self) -> dict[int, Tensor]:
        """The committed tensors by bucket index (clones)."""
        return {i: t.detach().clone() for i, t in self._committed.items()}

    def load_state_dict(self, state: dict[Any, Tensor]) -> None:
        """Replace the committed tensors (and drop anything staged)."""
        self._committed = {int(i): t.detach().clone() for i, t in state.items()}
        self._staged.clear()


class ErrorFeedback(StagedState):
    """Residuals r of what a compressor did not transmit, fed back undecayed (Karimireddy et al. 2019):
    acc = g + r; transmit C(acc); r' = acc - C(acc), so C(acc) + r' == g + r.

    The arithmetic is the working dtype (float32, float64 for float64 gradients). For sparsifiers r' is acc
    with the transmitted entries zeroed, so the identity holds bit for bit; for quantizers r' = acc - C(acc)
    is one subtraction (exact to its rounding), and over K steps sum C + r_K == sum g up to K roundings.
    """

    def __init__(self, name: str = "residual") -> None:
        super().__init__(name)

    def compensate(self, index: int, grad: Tensor, dtype: torch.dtype) -> Tensor:
        """A new tensor g + r in `dtype` (g alone before the bucket's first committed step)."""
        if index in self._staged:
            raise RuntimeError(f"{self.name}: bucket {index} was already compensated in this step")
        acc = grad.detach().reshape(-1).to(dtype, copy=True)
        residual = self.get(index)
        if residual is not None:
            if residual.shape != acc.shape:
                raise ValueError(f"{self.name}: bucket {index} has {acc.numel()} elements but its residual "
                                 f"has {residual.numel()} (buckets must keep their size)")
            acc.add_(residual)
        return acc

    def keep_rest(self, index: int, acc: Tensor, chosen: Tensor) -> None:
        """Stage acc with the transmitted positions zeroed as the new residual (modifies acc in place)."""
        self.stage(index, acc.index_fill_(0, chosen, 0.0))

    def keep_difference(self, index: int, acc: Tensor, transmitted: Tensor) -> None:
        """Stage acc - transmitted as the new residual."""
        self.stage(index, acc - transmitted)
