"""Mixture of experts: a DeepSeek-V3-style MoE layer and block, expert parallelism, balance (public API)."""

from duplexpipe.moe.balance import collect_losses, expert_parameters, moe_layers, update_bias_locally
from duplexpipe.moe.dispatch import ExpertGroup
from duplexpipe.moe.ffn import GatedMLP, GatedShared
from duplexpipe.moe.layer import CausalSelfAttention, Expert, MoEBlock, MoELayer
from duplexpipe.moe.router import Router, Routing, balance_loss
from duplexpipe.moe.tensor_parallel import moe_tp_plan

__all__ = [
    "CausalSelfAttention", "Expert", "ExpertGroup", "GatedMLP", "GatedShared", "MoEBlock", "MoELayer", "Router",
    "Routing", "balance_loss", "collect_losses", "expert_parameters", "moe_layers", "moe_tp_plan",
    "update_bias_locally",
]
