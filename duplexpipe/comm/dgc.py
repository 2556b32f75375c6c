"""Deep Gradient Compression (Lin et al., ICLR 2018): momentum correction, local clipping, momentum factor
masking and warm-up sparsity around top-k, as per-bucket state."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from duplexpipe.comm.feedback import StagedState

WARMUP_SPARSITY = (0.75, 0.9375, 0.984375, 0.996, 0.999)
"""The paper's exponentially increasing sparsity during warm-up, one value per warm-up stage."""


def dgc_density(step: int, ratio: float, warmup_steps: int) -> float:
    """Fraction of entries transmitted at optimizer step `step` (0-based): the warm-up stages' densities
    (1 - sparsity) that are above `ratio`, each for `warmup_steps` steps, then `ratio`."""
    stages = [1.0 - s for s in WARMUP_SPARSITY if 1.0 - s > ratio * (1 + 1e-9)] if warmup_steps > 0 else []
    stage = step // warmup_steps if warmup_steps > 0 else 0
    return stages[stage] if stage < len(stages) else ratio


def local_clip_threshold(clip_norm: float, world: int) -> float:
    """The norm a rank's mean gradient g is clipped to: clip_norm * sqrt(N) for N ranks.

    The paper (Sec. 3.2, Appendix C) clips each node's contribution G^k to the summed gradient G = sum_k G^k
    at N^(-1/2) of G's threshold (for N i.i.d. contributions, |G| ~ sqrt(N) |G^k|); its G^k carries the
    1/N of the average (Algorithm 1 adds grad / (N b)). Here a rank holds g = N G^k and the reducer
    averages, so |G^k| <= clip_norm / sqrt(N) reads |g| <= clip_norm * sqrt(N).
    """
    return clip_norm * math.sqrt(world)


class DGCMemory:
    """Per-bucket momentum u and accumulated velocity v (the error feedback of DGC).

    compensate(): g' = g clipped to norm local_clip_threshold(clip_norm, N) (local clipping by the bucket's
    norm; off when None: a Pipeline clips over the replica's whole model before and passes None);
    u = momentum * u + g' (momentum correction); v = v + u; the caller selects from v.
    update(): v and u are zeroed where v was transmitted (momentum factor masking). The optimizer must then
    apply the averaged transmitted v without momentum of its own: the momentum is folded in here.
    """

    def __init__(self, momentum: float, clip_norm: float | None, world: int) -> None:
        self.momentum = momentum
        self.clip = None if clip_norm is None else local_clip_threshold(clip_norm, world)
        self.u = StagedState("dgc momentum")
        self.v = StagedState("dgc velocity")

    def compensate(self, index: int, grad: Tensor, dtype: torch.dtype) -> Tensor:
        """The new velocity v of bucket `index` (staged with the new momentum); select from it."""
        g = grad.detach().reshape(-1).to(dtype, copy=True)
        if self.clip is not None:
            norm = torch.linalg.vector_norm(g)
            g.mul_(torch.clamp(self.clip / (norm + 1e-12), max=1.0))
        u_old, v_old = self.u.get(index), self.v.get(index)
        u = g if u_old is None else u_old.mul(self.momentum).add_(g)
        v = u.clone() if v_old is None else v_old.add(u)
        self.u.stage(index, u)
        self.v.stage(index, v)
        return v

    def keep_rest(self, index: int, acc: Tensor, chosen: Tensor) -> None:
        """Momentum factor masking: zero the transmitted positions of v (`acc`) and of u."""
        acc.index_fill_(0, chosen, 0.0)
        staged = self.u.staged(index)
        if staged is None:
            raise RuntimeError(f"dgc: bucket {index} was not compensated in this step")
        staged.index_fill_(0, chosen, 0.0)

    def commit(self) -> None:
        """Make the step's u and v current."""
        self.u.commit()
        self.v.commit()

    def rollback(self) -> None:
        """Forget the step's u and v."""
        self.u.rollback()
        self.v.rollback()

    def state_dict(self) -> dict[str, Any]:
        """Committed momentum and velocity per bucket."""
        return {"u": self.u.state_dict(), "v": self.v.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""
        self.u.load_state_dict(state["u"])
        self.v.load_state_dict(state["v"])
