"""Hugging Face MoE causal LMs (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3): each sparse block runs as a
`duplexpipe.moe` MoELayer with the family's exact routing, under the names of the published checkpoints; the
attention, norms and dense layers stay transformers' own modules; transformers' load-balancing loss is summed
layer by layer as the parts run, carried from part to part."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import (
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from duplexpipe.moe.balance import moe_layers
from duplexpipe.moe.ffn import MIXTRAL_PROJECTIONS, PROJECTIONS, GatedMLP, GatedShared
from duplexpipe.moe.layer import MoELayer
from duplexpipe.moe.router import Router

MOE_MODEL_TYPES: Mapping[str, type[nn.Module]] = {
    "qwen3_moe": Qwen3MoeForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM, "mixtral": MixtralForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
}
"""config.json's `model_type` -> the MoE causal LM class whose sparse blocks run as MoELayers."""
MOE_CLASSES = tuple(MOE_MODEL_TYPES.values())
"""The MoE causal LM classes `causal_lm_parts` accepts (Llama layout: embed_tokens, layers, norm, lm_head)."""
ROUTER_KEYS = ("router_tokens", "router_probs", "router_rows")
"""The message entries that carry transformers' load-balancing loss from part to part (a microbatch's
assignments per expert, routing probabilities per expert, routed rows; summed over the layers so far)."""
AUX_LOSS_CONFIGS = (Qwen3MoeConfig, Qwen2MoeConfig, MixtralConfig)
"""The configs of the families whose load-balancing loss transformers adds (`output_router_logits`,
`router_aux_loss_coef`); DeepSeek-V3 balances with its expert bias instead."""
_SPARSE = (Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock, MixtralSparseMoeBlock, DeepseekV3MoE)


@dataclass(frozen=True)
class Names:
    """How a family's published checkpoints name an MoE block's tensors (relative to the decoder layer)."""

    block: str
    """The block's name in the decoder layer ("mlp"; Mixtral's files: "block_sparse_moe")."""
    projections: tuple[str, str, str]
    """An expert's (gate, up, down) projections."""
    shared: Mapping[str, str]
    """MoELayer's shared-expert key prefixes -> the family's."""


_SHARED_DEEPSEEK = {"shared.": "shared_experts."}
_SHARED_QWEN2 = {"shared.expert.": "shared_expert.", "shared.gate.": "shared_expert_gate."}
NAMES = {"qwen3_moe": Names("mlp", PROJECTIONS, {}), "qwen2_moe": Names("mlp", PROJECTIONS, _SHARED_QWEN2),
         "mixtral": Names("block_sparse_moe", MIXTRAL_PROJECTIONS, {}),
         "deepseek_v3": Names("mlp", PROJECTIONS, _SHARED_DEEPSEEK)}
"""model_type -> the names its published checkpoints use (what transformers reads and save_pretrained writes)."""


class HFMoELayer(MoELayer):
    """An MoELayer standing in for a transformers sparse block: its state keys are the published checkpoint's
    (`gate.weight`, `gate.e_score_correction_bias`, `experts.{e}.gate_proj.weight` (Mixtral `w1`),
    `shared_experts.*` / `shared_expert.*` + `shared_expert_gate.weight`), through `global_state_key`."""

    def __init__(self, *args: Any, family: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.family = family
        """config.json's model_type of the model the block came from."""

    def global_state_key(self, key: str) -> str:
        """This layer's key as the family's checkpoints name it."""
        if key.startswith("router.gate."):
            return "gate." + key[len("router.gate."):]
        if key == "router.expert_bias":
            return "gate.e_score_correction_bias"
        for ours, theirs in NAMES[self.family].shared.items():
            if key.startswith(ours):
                return theirs + key[len(ours):]
        return key


def _router(block: Any, dtype: torch.dtype) -> Router:
    """The family's routing as a Router (on the meta device; `dtype` its gate's)."""
    gate = block.gate
    dim, experts, k = int(gate.hidden_dim), int(gate.num_experts), int(gate.top_k)
    if isinstance(block, DeepseekV3MoE):
        router = Router(dim, experts, k, "sigmoid", bool(gate.norm_topk_prob),
                        groups=(int(gate.num_group), int(gate.topk_group)), scale=float(gate.routed_scaling_factor),
                        logits_dtype=torch.float32, eps=1e-20)
        router.gate.to(dtype)
        assert router.expert_bias is not None
        router.expert_bias = router.expert_bias.to(gate.e_score_correction_bias.dtype)
        return router
    if isinstance(block, MixtralSparseMoeBlock) and block.jitter_noise > 0:
        raise ValueError(f"Mixtral's router_jitter_noise={block.jitter_noise} is not supported (random routing "
                         "in training would differ on every layout); set it to 0")
    normalize = True if isinstance(block, MixtralSparseMoeBlock) else bool(gate.norm_topk_prob)
    router = Router(dim, experts, k, "softmax", normalize, scores_dtype=torch.float32, bias=False)
    return router.to(dtype)


def _shared(block: Any) -> nn.Module | None:
    """The block's shared experts: transformers' own modules (DeepSeek-V3's MLP; Qwen2-MoE's, sigmoid-gated)."""
    if isinstance(block, DeepseekV3MoE):
        shared: nn.Module = block.shared_experts
        return shared
    if isinstance(block, Qwen2MoeSparseMoeBlock):
        return GatedShared(block.shared_expert, block.shared_expert_gate)
    return None


def convert_block(block: Any, family: str) -> HFMoELayer:
    """An HFMoELayer computing what transformers' sparse `block` computes (routing, experts, shared experts), on
    its device: the experts' weights are copied out of its fused tensors (none on the meta device); the shared
    experts are the block's own modules."""
    fused = block.experts
    param = fused.gate_up_proj
    experts, hidden, dim = int(param.shape[0]), int(param.shape[1]) // 2, int(param.shape[2])
    with torch.device("meta"):
        router = _router(block, param.dtype)
        names = NAMES[family].projections
        layer = HFMoELayer(dim, hidden, experts, router.top_k, router=router, family=family,
                           expert=lambda _: GatedMLP(dim, hidden, fused.act_fn, names).to(param.dtype))
    if not param.is_meta:
        layer.to_empty(device=param.device)
        layer.reset_load()
        _copy_weights(layer, block)
    layer.shared = _shared(block)
    return layer


@torch.no_grad()
def _copy_weights(layer: HFMoELayer, block: Any) -> None:
    """The router's weight (and bias) and each expert's projections from the block's fused tensors."""
    layer.router.gate.weight.copy_(block.gate.weight)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(block.gate.e_score_correction_bias)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    hidden = gate_up.shape[1] // 2
    for e, expert in layer.experts.items():
        assert isinstance(expert, GatedMLP)
        gate, up, proj = expert.projections()
        gate.weight.copy_(gate_up[int(e), :hidden])
        up.weight.copy_(gate_up[int(e), hidden:])
        proj.weight.copy_(down[int(e)])


def _renamed(prefix: str, published: str, key: str) -> str:
    """A decoder layer's key with its MoE block's name as the published files spell it."""
    return published + key[len(prefix):] if key.startswith(prefix) else key


def _clone(module: nn.Module, **children: nn.Module) -> nn.Module:
    """A shallow copy of `module` with some children replaced (the original and its other children untouched)."""
    out = copy.copy(module)
    out._modules = {**module._modules, **children}
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    out._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    return out


def moe_family(model: nn.Module) -> str | None:
    """The model_type of a supported MoE causal LM (None for any other model)."""
    for family, cls in MOE_MODEL_TYPES.items():
        if isinstance(model, cls):
            return family
    return None


def with_moe_layers(model: nn.Module) -> nn.Module:
    """A view of an MoE causal LM whose sparse blocks are HFMoELayers (the same model when it has none left): a
    shallow copy sharing every other module with `model` (which stays as it was)."""
    family = moe_family(model)
    base: Any = getattr(model, "model", None)
    if family is None or base is None or not any(isinstance(m, _SPARSE) for m in base.layers.modules()):
        return model
    published = NAMES[family].block
    layers: list[nn.Module] = []
    for layer in base.layers:
        if isinstance(layer.mlp, _SPARSE):
            layer = _clone(layer, mlp=convert_block(layer.mlp, family))
            if published != "mlp":  # a global_state_key hook of this layer alone (model.state_names)
                object.__setattr__(layer, "global_state_key", functools.partial(_renamed, "mlp.", f"{published}."))
        layers.append(layer)
    return _clone(model, model=_clone(base, layers=nn.ModuleList(layers)))


def set_bias_update_speed(model: nn.Module, speed: float) -> None:
    """Turn on the aux-loss-free balance of a model's MoE layers: after each optimizer step every expert bias
    moves by speed x sign(mean load - load) (`MoELayer.update_bias`). Only routers with a bias (DeepSeek-V3's
    e_score_correction_bias) have one to move."""
    if not speed >= 0:
        raise ValueError(f"router bias update speed must be >= 0, got {speed!r}")
    layers = [layer for layer in moe_layers(model) if isinstance(layer, HFMoELayer)]
    biased = [layer for layer in layers if layer.router.expert_bias is not None]
    if speed and layers and not biased:
        raise ValueError(f"router bias update speed {speed}: the {layers[0].family} router has no expert bias "
                         "(only deepseek_v3's e_score_correction_bias moves)")
    for layer in biased:
        layer.bias_update_speed = float(speed)


class RouterLoss:
    """transformers' load-balancing loss (`load_balancing_loss_func` of Qwen-MoE and Mixtral) of one microbatch:
    E x sum_e f_e P_e over the assignments and routing probabilities of every MoE layer together, summed in
    float32 layer by layer in the model's order, as transformers sums them. A part adds its layers to the sums
    it received (`add`) and passes them on (`ROUTER_KEYS`); the last part's `value` is router_aux_loss_coef x
    the loss."""

    def __init__(self, num_experts: int, top_k: int, coef: float) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.coef = coef

    @classmethod
    def of(cls, model: nn.Module) -> RouterLoss | None:
        """The loss of a model whose config asks for it (`output_router_logits`), else None."""
        config = model.config
        if not isinstance(config, AUX_LOSS_CONFIGS) or moe_family(model) is None or not config.output_router_logits:
            return None
        layers = moe_layers(model)
        if not layers:
            return None
        return cls(layers[0].num_experts, layers[0].top_k, float(config.router_aux_loss_coef))

    @contextlib.contextmanager
    def recording(self, module: nn.Module) -> Iterator[list[Tensor]]:
        """Around a forward of `module`: the router logits of its MoE layers, in the order they ran."""
        logits: list[Tensor] = []
        hooks = [layer.router.register_forward_hook(lambda _m, _i, out: logits.append(out.logits))
                 for layer in moe_layers(module)]
        try:
            yield logits
        finally:
            for hook in hooks:
                hook.remove()

    def start(self, device: torch.device) -> dict[str, Tensor]:
        """The sums before the first layer."""
        zeros = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        return {"router_tokens": zeros, "router_probs": zeros.clone(),
                "router_rows": torch.zeros((), dtype=torch.float64, device=device)}

    def add(self, sums: Mapping[str, Tensor], logits: list[Tensor], mask: Tensor | None) -> dict[str, Tensor]:
        """`sums` plus these layers' assignments, probabilities and rows (the padding of a 2-D attention mask left
        out), as `load_balancing_loss_func` adds them."""
        if not logits:  # no MoE layer here: the sums go on as new tensors (the message's autograd needs an op)
            return {key: value.clone() for key, value in sums.items()}
        tokens, probs, rows = sums["router_tokens"], sums["router_probs"], sums["router_rows"]
        flat = None if mask is None else mask.reshape(-1).to(dtype=torch.float32)
        for layer in logits:
            weights = torch.nn.functional.softmax(layer, dim=-1)
            chosen = torch.topk(weights, self.top_k, dim=-1).indices
            if flat is None:
                tokens = tokens + torch.histc(chosen.reshape(-1).to(torch.float32), bins=self.num_experts, min=0,
                                              max=self.num_experts)
                probs = probs + weights.float().sum(dim=0)
                rows = rows + weights.shape[0]
            else:
                tokens = tokens + torch.zeros_like(tokens).scatter_add_(0, chosen.reshape(-1),
                                                                        flat.repeat_interleave(self.top_k))
                probs = probs + (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
                rows = rows + flat.sum()
        return {"router_tokens": tokens, "router_probs": probs, "router_rows": rows}

    def value(self, sums: Mapping[str, Tensor]) -> Tensor:
        """router_aux_loss_coef x the loss of the summed layers."""
        rows = sums["router_rows"]
        share = (sums["router_tokens"] / rows) * (sums["router_probs"] / rows).unsqueeze(0)
        return self.coef * (torch.sum(share) * self.num_experts)
