"""The MoE router: softmax or sigmoid scores, top-k selection (optionally group-limited) shifted by a per-expert
bias, the balance loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROUTERS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """Where one batch of tokens goes: each token's top-k experts and their combine weights."""

    experts: Tensor
    """[tokens, k] expert indices (int64)."""
    weights: Tensor
    """[tokens, k] combine weights (the scores of the chosen experts, normalised when asked)."""
    affinity: Tensor
    """[tokens, E] normalised scores (rows sum to 1): what the balance loss spreads."""
    logits: Tensor | None = None
    """[tokens, E] the gate's logits (what transformers records as a layer's router logits)."""


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Router {name} must be an int >= 1, got {value!r}")


def _check_groups(groups: tuple[int, int] | None, num_experts: int, top_k: int) -> None:
    """(n_group, topk_group): groups of equal size with at least two experts each (a group scores as the sum of its
    top two), and enough experts in the chosen groups for the top k."""
    if groups is None:
        return
    count, chosen = groups
    _positive("n_group", count)
    _positive("topk_group", chosen)
    if num_experts % count or num_experts // count < 2:
        raise ValueError(f"Router n_group={count} must divide num_experts={num_experts} into groups of two or "
                         "more experts")
    if chosen > count or chosen * (num_experts // count) < top_k:
        raise ValueError(f"Router topk_group={chosen} of n_group={count} groups leaves fewer than top_k={top_k} "
                         "experts to choose from")


class Router(nn.Module):
    """Scores every token against every expert and picks its top k.

    "softmax": scores = softmax(logits); "sigmoid" (DeepSeek-V3): scores = sigmoid(logits). The buffer
    `expert_bias` (absent with `bias=False`) is added to the scores only to choose the experts (the
    aux-loss-free balance): the combine weights are the unbiased scores of the chosen experts, divided by their
    sum (+ `eps`) when `normalize` (always for sigmoid, as DeepSeek-V3 does, unless told otherwise), times
    `scale`. `groups` = (n_group, topk_group): DeepSeek-V3's group-limited selection (each group scores as the
    sum of its two best biased scores; experts only from the best topk_group groups). Precision as transformers
    computes it: `logits_dtype` casts the tokens and the gate's weight before the projection (DeepSeek-V3:
    float32), `scores_dtype` the logits before the score function (Qwen-MoE, Mixtral: float32); the weights are
    returned in the logits' dtype, unless `logits_dtype` set it.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, kind: str = "softmax",
                 normalize: bool | None = None, *, groups: tuple[int, int] | None = None, scale: float = 1.0,
                 logits_dtype: torch.dtype | None = None, scores_dtype: torch.dtype | None = None,
                 bias: bool = True, eps: float = 0.0) -> None:
        super().__init__()
        if kind not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {kind!r}")
        _check_groups(groups, num_experts, top_k)
        self.kind = kind
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize = (kind == "sigmoid") if normalize is None else normalize
        self.groups = groups
        self.scale = float(scale)
        self.eps = float(eps)
        self.logits_dtype = logits_dtype
        self.scores_dtype = scores_dtype
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.expert_bias: Tensor | None
        self.register_buffer("expert_bias", torch.zeros(num_experts) if bias else None)

    def forward(self, x: Tensor) -> Routing:
        """Route the tokens `x` [tokens, dim]."""
        if self.logits_dtype is None:
            logits = self.gate(x)
        else:
            logits = F.linear(x.to(self.logits_dtype), self.gate.weight.to(self.logits_dtype))
        scored = logits if self.scores_dtype is None else logits.to(self.scores_dtype)
        scores = scored.softmax(dim=-1) if self.kind == "softmax" else scored.sigmoid()
        experts = self._select(scores.detach())
        weights = scores.gather(-1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.eps) if self.eps else \
                weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        if self.logits_dtype is None:
            weights = weights.to(logits.dtype)
        affinity = scores if self.kind == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return Routing(experts, weights, affinity, logits)

    def _select(self, scores: Tensor) -> Tensor:
        """[tokens, k] the chosen experts: top k of the biased scores (within the best groups)."""
        biased = scores if self.expert_bias is None else scores + self.expert_bias
        if self.groups is not None:
            count, chosen = self.groups
            grouped = biased.view(-1, count, self.num_experts // count)
            best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(chosen, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            biased = biased.masked_fill(~keep.repeat_interleave(self.num_experts // count, dim=1), float("-inf"))
        return biased.topk(self.top_k, dim=-1, sorted=True).indices


def balance_loss(routing: Routing, counts: Tensor) -> Tensor:
    """The auxiliary balance loss E * sum_e f_e * P_e of one batch of tokens: f_e the fraction of the
    token-to-expert assignments that went to expert e, P_e its mean normalised score (Switch Transformer,
    DeepSeek-V3's balance term over the batch). Minimal (1) when both are uniform."""
    tokens, num_experts = routing.affinity.shape
    if tokens == 0:
        return routing.affinity.sum() * 0
    fraction = counts.to(routing.affinity.dtype) / (tokens * routing.experts.shape[1])
    return num_experts * (fraction * routing.affinity.mean(dim=0)).sum()
