"""Hugging Face causal LMs as pipeline parts (Llama layout and GPT-2), with the models' own loss and names."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from duplexpipe.model.hf_moe import MOE_CLASSES, MOE_MODEL_TYPES, ROUTER_KEYS, RouterLoss, with_moe_layers
from duplexpipe.model.split import check_balance, check_split_size, uniform_balance

try:
    from transformers import (
        GPT2LMHeadModel,
        LlamaForCausalLM,
        MistralForCausalLM,
        PretrainedConfig,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
    )
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("duplexpipe.model.hf needs transformers: pip install 'duplexpipe[hf]'") from exc

LLAMA_LAYOUT = (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, *MOE_CLASSES)
"""Models with `model.embed_tokens`, `model.layers`, `model.norm`, `model.rotary_emb` and `lm_head`."""
SUPPORTED = (*LLAMA_LAYOUT, GPT2LMHeadModel)
"""The model classes `causal_lm_parts` accepts."""
MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
    "gpt2": GPT2LMHeadModel, **MOE_MODEL_TYPES,
}
"""config.json's `model_type` -> the causal LM class `causal_lm_parts` splits."""
IGNORE_INDEX = -100
"""Label value that the loss skips, as in transformers."""
_MASKS: dict[str, Callable[..., Any]] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


class CausalLMPart(nn.Module):
    """A contiguous piece of a causal LM: [embedding] + decoder layers + [final norm and head].

    The first part takes `input_ids`, the others `hidden_states`; each also takes an optional
    `attention_mask` (batch, seq) of 1 for real and 0 for padding tokens and optional
    `position_ids` (batch, seq). A part passes the hidden states on, as a dict together with the mask
    and position ids when it was given them (a bare tensor otherwise); the last part returns logits.
    Causal masks and rotary embeddings are recomputed in every part by the library's own code, so
    the parts compute what `model(input_ids, attention_mask, position_ids, use_cache=False)` does
    (training: no KV cache; packed sequences in `position_ids` get the library's packed mask).
    Its state keys map to the model's own (`global_state_key`: `layers.3.mlp.up_proj.weight` ->
    `model.layers.3.mlp.up_proj.weight`), so checkpoints hold transformers' names.
    """

    def __init__(self, model: Any, index: int, num_parts: int, layer_ids: range) -> None:
        super().__init__()
        config = model.config
        self.config = config
        self.model_class = type(model).__name__
        """The transformers class the part was cut from (config.json's `architectures`)."""
        self.base_prefix = str(model.base_model_prefix)
        """Where the decoder sits in the model: "model" (Llama layout) or "transformer" (GPT-2)."""
        self.index = index
        self.num_parts = num_parts
        self.layer_ids = layer_ids
        self.is_first = index == 0
        self.is_last = index == num_parts - 1
        self.input_name = "input_ids" if self.is_first else "hidden_states"
        self.router_loss = RouterLoss.of(model)
        """transformers' load-balancing loss of an MoE model with `output_router_logits` (else None): in training
        a part passes its sums on (`ROUTER_KEYS`), the last returns {"logits", "aux_loss"}."""
        self.sequence_shards = 1
        """TP ranks sharing the sequence of the hidden states (sequence parallelism; set by the Pipeline): each holds
        1/sequence_shards of the positions, while masks and rotary positions are built for the whole sequence."""

    def extra_repr(self) -> str:
        return f"part {self.index} of {self.num_parts}, layers {self.layer_ids.start}..{self.layer_ids.stop - 1}"

    def global_state_key(self, key: str) -> str:
        """The model's own name of this part's state key: `lm_head.*` stays, the rest is under the decoder
        (`norm.weight` -> `model.norm.weight`; layers keep their global index)."""
        return key if key.split(".", 1)[0] == "lm_head" else f"{self.base_prefix}.{key}"

    def forward(self, *args: Tensor | None, **kwargs: Tensor | None) -> Tensor | dict[str, Tensor]:
        """input_ids or hidden_states [, attention_mask [, position_ids]] -> next part's input or logits."""
        x, mask, position_ids, sums = self._bind(args, kwargs)
        if self.is_first and x.shape[1] % self.sequence_shards:
            raise ValueError(f"sequence parallelism: {x.shape[1]} positions are not divisible by the TP degree "
                             f"{self.sequence_shards}")
        positions = position_ids
        if positions is None:  # what the models do without position_ids (hidden states may be a sequence shard)
            length = x.shape[1] * (1 if self.is_first else self.sequence_shards)
            positions = torch.arange(length, device=x.device).unsqueeze(0)
        hidden = self.embed(x, positions) if self.is_first else x
        loss = self.router_loss if torch.is_grad_enabled() else None
        recording: contextlib.AbstractContextManager[list[Tensor]] = \
            contextlib.nullcontext([]) if loss is None else loss.recording(self)
        with recording as router_logits:
            hidden = self.run_layers(hidden, mask, positions)
        if loss is not None:  # transformers' load-balancing loss, summed over the layers so far
            sums = loss.add(sums or loss.start(hidden.device), router_logits, mask)
        if self.is_last:
            logits = self.head(hidden)
            return logits if loss is None else {"logits": logits, "aux_loss": loss.value(sums)}
        if mask is None and position_ids is None and loss is None:
            return hidden
        out = {"hidden_states": hidden, **(sums if loss is not None else {})}
        if mask is not None:
            out["attention_mask"] = mask
        if position_ids is not None:
            out["position_ids"] = position_ids
        return out

    def _bind(self, args: tuple[Tensor | None, ...], kwargs: dict[str, Tensor | None]
              ) -> tuple[Tensor, Tensor | None, Tensor | None, dict[str, Tensor]]:
        names = (self.input_name, "attention_mask", "position_ids")
        carried = {k: v for k, v in kwargs.items() if k in ROUTER_KEYS and v is not None}
        kwargs = {k: v for k, v in kwargs.items() if k not in ROUTER_KEYS}
        if len(args) > len(names):
            raise TypeError(f"part {self.index} takes at most {len(names)} inputs {names}, got {len(args)}")
        bound = dict(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key not in names or key in bound:
                reason = "given twice" if key in bound else f"expected one of {names}"
                raise TypeError(f"part {self.index}: unexpected input {key!r} ({reason})")
            bound[key] = value
        x = bound.get(self.input_name)
        if not isinstance(x, Tensor):
            raise TypeError(f"part {self.index} needs {self.input_name!r} as a tensor, got {type(x).__name__}")
        return x, bound.get("attention_mask"), bound.get("position_ids"), carried

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """Token ids -> the first layer's input (first part only)."""
        raise NotImplementedError

    def run_layers(self, hidden: Tensor, mask: Tensor | None, positions: Tensor) -> Tensor:
        """Run this part's decoder layers."""
        raise NotImplementedError

    def whole(self, hidden: Tensor) -> Tensor:
        """A stand-in for the hidden states of the whole sequence (shape, dtype and device only, no copy): what the
        library's mask builders read when the hidden states are this rank's sequence shard."""
        if self.sequence_shards == 1:
            return hidden
        b, t, d = hidden.shape
        return hidden.detach()[:, :1].expand(b, t * self.sequence_shards, d)

    def head(self, hidden: Tensor) -> Tensor:
        """Final norm and the projection to logits (last part only)."""
        raise NotImplementedError


def _mask_kind(config: PretrainedConfig, layer: int) -> str:
    """The attention kind of `layer` as the Llama-layout models choose it (Qwen2: layer_types; Mistral:
    sliding everywhere when a window is set)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return str(types[layer])
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


class LlamaLayoutPart(CausalLMPart):
    """A part of a Llama, Mistral or Qwen2 causal LM (RMSNorm, rotary embeddings, no position table)."""

    def __init__(self, model: Any, index: int, num_parts: int, layer_ids: range) -> None:
        super().__init__(model, index, num_parts, layer_ids)
        base = model.model
        self.embed_tokens = base.embed_tokens if self.is_first else None
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in layer_ids})
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.kinds = {i: _mask_kind(model.config, i) for i in layer_ids}
        unknown = sorted(set(self.kinds.values()) - set(_MASKS))
        if unknown:
            raise ValueError(f"layers of kind {unknown} are not supported; expected {sorted(_MASKS)}")

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        assert self.embed_tokens is not None
        out: Tensor = self.embed_tokens(input_ids)
        return out

    def run_layers(self, hidden: Tensor, mask: Tensor | None, positions: Tensor) -> Tensor:
        masks = {kind: _MASKS[kind](config=self.config, inputs_embeds=self.whole(hidden), attention_mask=mask,
                                    past_key_values=None, position_ids=positions)
                 for kind in sorted(set(self.kinds.values()))}
        rotary = self.rotary_emb(hidden, positions)
        for i in self.layer_ids:
            hidden = self.layers[str(i)](hidden, attention_mask=masks[self.kinds[i]], position_ids=positions,
                                         past_key_values=None, use_cache=False, position_embeddings=rotary)
        return hidden

    def head(self, hidden: Tensor) -> Tensor:
        assert self.norm is not None and self.lm_head is not None
        out: Tensor = self.lm_head(self.norm(hidden))
        return out


class GPT2Part(CausalLMPart):
    """A part of a GPT-2 LM (learned position table, LayerNorm, head tied to the token embedding)."""

    def __init__(self, model: Any, index: int, num_parts: int, layer_ids: range) -> None:
        super().__init__(model, index, num_parts, layer_ids)
        if getattr(model.config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True is not supported (no encoder states flow "
                             "between parts); use a decoder-only config")
        base = model.transformer
        self.wte = base.wte if self.is_first else None
        self.wpe = base.wpe if self.is_first else None
        self.drop = base.drop if self.is_first else None
        self.h = nn.ModuleDict({str(i): base.h[i] for i in layer_ids})
        self.ln_f = base.ln_f if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        assert self.wte is not None and self.wpe is not None and self.drop is not None
        out: Tensor = self.drop(self.wte(input_ids) + self.wpe(positions))
        return out

    def run_layers(self, hidden: Tensor, mask: Tensor | None, positions: Tensor) -> Tensor:
        if mask is not None and mask.dim() < 4:
            mask = mask.view(hidden.shape[0], -1)
        causal = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask,
                                    past_key_values=None, position_ids=positions)
        for i in self.layer_ids:
            hidden = self.h[str(i)](hidden, past_key_values=None, attention_mask=causal, use_cache=False,
                                    position_ids=positions)
        return hidden

    def head(self, hidden: Tensor) -> Tensor:
        assert self.ln_f is not None and self.lm_head is not None
        out: Tensor = self.lm_head(self.ln_f(hidden))
        return out


def num_layers(model: Any) -> int:
    """Decoder layers of a supported causal LM."""
    layers = model.transformer.h if isinstance(model, GPT2LMHeadModel) else model.model.layers
    return min(len(layers), int(model.config.num_hidden_layers))


def causal_lm_parts(model: nn.Module, num_parts: int, balance: Sequence[int] | None = None) -> list[CausalLMPart]:
    """Split a transformers causal LM into `num_parts` parts whose composition maps input_ids to logits.

    Decoder layers are spread evenly (counts differ by at most one, the first parts take the
    remainder) or by an explicit `balance` (layers per part). The embedding goes with the first
    part, the final norm and the head with the last. The parts share the model's modules: a tied
    input/output embedding stays one Parameter in two parts, and `Pipeline` sums its gradients.
    Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel and the MoE
    models Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM, whose sparse blocks
    run as `duplexpipe.moe` layers (`hf_moe`; their experts are copies of the fused tensors, not shared).
    """
    if not isinstance(model, SUPPORTED):
        names = ", ".join(cls.__name__ for cls in SUPPORTED)
        raise ValueError(f"causal_lm_parts does not support {type(model).__name__}; supported: {names}")
    if not isinstance(num_parts, int) or isinstance(num_parts, bool):
        raise ValueError(f"num_parts must be an integer, got {num_parts!r}")
    model = with_moe_layers(model)
    n = num_layers(model)
    check_split_size(n, num_parts)
    counts = uniform_balance(n, num_parts) if balance is None else check_balance(balance, n, num_parts)
    cls = GPT2Part if isinstance(model, GPT2LMHeadModel) else LlamaLayoutPart
    parts: list[CausalLMPart] = []
    start = 0
    for k, count in enumerate(counts):
        parts.append(cls(model, k, num_parts, range(start, start + count)))
        start += count
    return parts


def counted_tokens(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Tokens the loss counts in (batch, seq) labels: every label after the first column that is not ignored."""
    if labels.dim() != 2:
        raise ValueError(f"labels must be (batch, seq), got shape {tuple(labels.shape)}")
    return int((labels[:, 1:] != ignore_index).sum())


def causal_lm_targets(labels: Tensor, ignore_index: int = IGNORE_INDEX, *, tokens: int | None = None,
                      rows: int | None = None) -> dict[str, Tensor]:
    """Targets for `causal_lm_loss` that weight every counted token of the batch equally.

    Each row carries the batch's counted-token and row totals, so the pipelined loss (microbatch
    losses weighted by their share of rows) equals the whole-batch loss even when padding with
    `ignore_index` leaves microbatches with different token counts. `tokens` and `rows` override the
    totals (data parallelism: the job's tokens and this replica's rows times the replicas, so the mean
    over replicas is the job's token mean).
    """
    count = counted_tokens(labels, ignore_index) if tokens is None else tokens
    if count == 0:
        raise ValueError(f"labels count no token: every label after the first column is {ignore_index}")
    total_rows = labels.shape[0] if rows is None else rows
    full = torch.full((labels.shape[0],), 0, dtype=torch.int64, device=labels.device)
    return {"labels": labels, "batch_tokens": full + count, "batch_rows": full + total_rows}


def _summed_loss(logits: Tensor, labels: Tensor, reduction: str) -> Tensor:
    """Next-token cross entropy as transformers computes it (labels shifted left, -100 ignored), in the logits'
    dtype when that is float32 or wider (float64 stays float64), else in float32 as transformers does."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(logits.device)
    return F.cross_entropy(logits.to(dtype).reshape(-1, logits.shape[-1]), shifted, ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def causal_lm_loss(logits: Tensor | Mapping[str, Tensor], targets: Tensor | Mapping[str, Tensor]) -> Tensor:
    """The loss `model(input_ids, labels=labels)` computes: next-token cross entropy, -100 ignored.

    `targets` is the labels (batch, seq), unshifted: the mean over this microbatch's counted tokens
    (the pipelined loss then equals the whole-batch loss when every row counts the same number of
    tokens), or `causal_lm_targets(labels)`: exact for any padding. The loss keeps the logits' dtype
    when it is float32 or wider (transformers' own loss casts float64 logits down to float32). An MoE model's
    {"logits", "aux_loss"} adds its aux loss (router_aux_loss_coef x the load-balancing loss), as transformers does.
    """
    if isinstance(logits, Mapping):
        return causal_lm_loss(logits["logits"], targets) + logits["aux_loss"]
    if isinstance(targets, Tensor):
        return _summed_loss(logits, targets, "mean")
    if not isinstance(targets, Mapping) or set(targets) != {"labels", "batch_tokens", "batch_rows"}:
        got = sorted(targets) if isinstance(targets, Mapping) else type(targets).__name__
        raise ValueError(f"targets must be labels or causal_lm_targets(labels), got {got}")
    labels = targets["labels"]
    total = _summed_loss(logits, labels, "sum")
    # this microbatch's share of the batch's tokens, so that (rows / batch rows) * loss sums to sum / tokens
    share = targets["batch_tokens"][0].double() * labels.shape[0] / targets["batch_rows"][0].double()
    return total / share.to(total.dtype)
