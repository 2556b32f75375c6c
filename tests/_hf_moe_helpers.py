"""Tiny transformers MoE causal LMs of every supported family (random init from configs, no download), saved as
transformers saves them (per-expert tensors, as published) or with the experts fused as they sit in memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from _hf_helpers import VOCAB, _seeded, transformers
from safetensors.torch import save_file
from torch import nn

_BASE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
             max_position_embeddings=64, attn_implementation="eager", experts_implementation="eager")
FAMILIES: dict[str, tuple[Any, dict[str, Any]]] = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                                   num_experts_per_tok=2, head_dim=8, norm_topk_prob=True)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                                   num_experts_per_tok=2, shared_expert_intermediate_size=24)),
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": (transformers.DeepseekV3Config, dict(intermediate_size=48, moe_intermediate_size=16,
                                                       n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                                       topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                                       routed_scaling_factor=2.5, q_lora_rank=16, kv_lora_rank=8,
                                                       num_key_value_heads=4,
                                                       qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
}
"""model_type -> (config class, its tiny settings): 4 experts (DeepSeek-V3: 8 in 4 groups), top 2."""
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.05)
"""Config settings that turn transformers' load-balancing loss on."""


def tiny_moe(family: str, layers: int = 4, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny float64 MoE causal LM of `family` (eager attention and experts: float64 on the CPU)."""
    cls, settings = FAMILIES[family]
    config = cls(**{**_BASE, **settings, "num_hidden_layers": layers, **overrides})
    return _seeded(lambda: transformers.AutoModelForCausalLM.from_config(config), seed).double()


def save_published(model: nn.Module, path: Path, **kwargs: Any) -> None:
    """transformers' save_pretrained: every expert's tensors on their own, as the published checkpoints are."""
    model.save_pretrained(path, **kwargs)


def save_fused(model: nn.Module, path: Path) -> None:
    """The model's tensors as they sit in transformers' memory (experts fused: mlp.experts.gate_up_proj
    [E, 2I, D], mlp.experts.down_proj [E, D, I]) in one safetensors file, with its config.json."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def set_config(path: Path, **values: Any) -> None:
    """Change config.json of a saved model."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **values}, indent=1))


def steer(model: nn.Module, experts: range) -> None:
    """DeepSeek-V3: an e_score_correction_bias of -1e3 on `experts`: they are never chosen (selection only)."""
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias[list(experts)] = -1e3
