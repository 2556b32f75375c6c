"""The MoE router: softmax or sigmoid scores, top-k selection shifted by a per-expert bias, the balance loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


class Router(nn.Module):
    """Scores every token against every expert and picks its top k.

    "softmax": scores = softmax(logits); "sigmoid" (DeepSeek-V3): scores = sigmoid(logits). The buffer
    `expert_bias` is added to the scores only to choose the experts (the aux-loss-free balance): the combine
    weights are the unbiased scores of the chosen experts, divided by their sum when `normalize` (always
    for sigmoid, as DeepSeek-V3 does).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, kind: str = "softmax",
                 normalize: bool | None = None) -> None:
        super().__init__()
        if kind not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {kind!r}")
        self.kind = kind
        self.top_k = top_k
        self.normalize = (kind == "sigmoid") if normalize is None else normalize
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.expert_bias: Tensor
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: Tensor) -> Routing:
        """Route the tokens `x` [tokens, dim]."""
        logits = self.gate(x)
        scores = logits.softmax(dim=-1) if self.kind == "softmax" else logits.sigmoid()
        biased = scores.detach() + self.expert_bias.to(scores.dtype)
        experts = biased.topk(self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, experts)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        affinity = scores if self.kind == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return Routing(experts, weights, affinity)


def balance_loss(routing: Routing, counts: Tensor) -> Tensor:
    """The auxiliary balance loss E * sum_e f_e * P_e of one batch of tokens: f_e the fraction of the
    token-to-expert assignments that went to expert e, P_e its mean normalised score (Switch Transformer,
    DeepSeek-V3's balance term over the batch). Minimal (1) when both are uniform."""
    tokens, num_experts = routing.affinity.shape
    if tokens == 0:
        return routing.affinity.sum() * 0
    fraction = counts.to(routing.affinity.dtype) / (tokens * routing.experts.shape[1])
    return num_experts * (fraction * routing.affinity.mean(dim=0)).sum()
