"""Hugging Face checkpoints in: each rank builds its parts on the meta device and reads only its own tensors from the
safetensors files; `pipe.step(input_ids, labels)` then weights every counted token of the batch alike."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from duplexpipe.files import read_capped
from duplexpipe.model.hf import MODEL_TYPES, CausalLMPart, causal_lm_parts, causal_lm_targets, counted_tokens
from duplexpipe.model.hf_files import INDEX_FILE, SINGLE_FILE, StoredTensor, read_into, stored_tensors
from duplexpipe.model.hf_fused import FusedSlice, fused_source, renamed_source
from duplexpipe.model.hf_moe import set_bias_update_speed, with_moe_layers
from duplexpipe.model.split import PartInfo, Partition, count_params
from duplexpipe.model.state_names import part_state_keys
from duplexpipe.moe.balance import moe_layers
from duplexpipe.moe.dispatch import ExpertGroup
from duplexpipe.moe.layer import MoELayer

log = logging.getLogger("duplexpipe.pretrained")
MAX_CONFIG_BYTES = 16 * 2**20
"""Largest config.json read (16 MiB)."""
MAX_LAYERS = 4096
"""Most decoder layers a model's config may state (the deepest published models have about a hundred): a larger
count is a crafted or broken config that would build layers until memory runs out."""
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
               "num_key_value_heads", "head_dim")
"""Config fields (transformers' names, mapped for every family) that count something: whole numbers >= 1 when set."""


def check_config_sizes(config: Any, root: Path) -> None:
    """ValueError naming config.json's field when a size in it is not a whole number >= 1, or the layers are over
    MAX_LAYERS: before any layer is built."""
    for name in SIZE_FIELDS:
        value = getattr(config, name, None)
        if value is None and name in ("num_key_value_heads", "head_dim", "intermediate_size"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{root / 'config.json'}: {name} must be a whole number >= 1, got {value!r}")
    if config.num_hidden_layers > MAX_LAYERS:
        raise ValueError(f"{root / 'config.json'}: num_hidden_layers {config.num_hidden_layers:,} is over "
                         f"{MAX_LAYERS:,} decoder layers; is this config.json the model's?")


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "") if names else "none"


def _config_dtype(hf_config: object) -> torch.dtype:
    """The checkpoint's dtype as a transformers config (its config.json) states it (float32 when it states none)."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def check_model_dir(path: str | Path) -> str:
    """The model_type of a Hugging Face model directory `from_pretrained` can load; ValueError naming what is wrong
    (not a directory with config.json, an unsupported model_type, quantized weights, no safetensors weights). Reads
    no tensor."""
    root = Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(f"{path} is not a model directory (no config.json)")
    try:
        config = json.loads(read_capped(root / "config.json", MAX_CONFIG_BYTES, "model config"))
        model_type = config.get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"{root / 'config.json'} is not a JSON object ({exc})") from None
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(MODEL_TYPES))}")
    quantized = config.get("quantization_config")
    if quantized:  # e.g. DeepSeek-V3's FP8 release: its weights need their scales, which nothing here applies
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise ValueError(f"{path}: quantized weights (quantization_config, quant_method {method!r}) are not supported; "
                         "use a checkpoint in bf16, fp16 or fp32 (e.g. dequantized by transformers and saved)")
    if not any((root / name).is_file() for name in (INDEX_FILE, SINGLE_FILE)):
        raise ValueError(f"{root} holds no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); save the model with "
                         "transformers' save_pretrained (safetensors is its default)")
    return str(model_type)


def _ignored(model: Any) -> re.Pattern[str]:
    """Names a checkpoint may hold that the model does not load (as transformers ignores them)."""
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []) + [r"rotary_emb\.inv_freq$"]
    return re.compile("|".join(f"(?:{p})" for p in patterns))


@dataclass
class PretrainedModel:
    """A Hugging Face model directory opened for pipelining: its config and the whole model on the meta device
    (no memory); each part is filled from the files by `fill` on the rank that holds it."""

    path: Path
    """The model directory."""
    model: nn.Module
    """The whole causal LM on the meta device (the parts are cut from it)."""
    files: dict[str, StoredTensor]
    """Tensor name -> where the safetensors files hold it."""
    tied: dict[str, str]
    """Tied names -> the name stored in the files (GPT-2: lm_head.weight -> transformer.wte.weight)."""
    aliases: dict[str, str | FusedSlice] = field(default_factory=dict)
    """Names the model needs that the files hold otherwise (set by `check`): under transformers' in-memory name
    (Mixtral's `mlp.` for `block_sparse_moe.`), or an expert's projection as a slice of a fused tensor."""

    @classmethod
    def open(cls, path: str | Path, dtype: torch.dtype | None = None) -> PretrainedModel:
        """Check the directory and build the model on the meta device in `dtype` (None: the checkpoint's).

        Raises ValueError for a path that is not a model directory, an unsupported model_type, missing
        safetensors files, tensors the model needs that the files lack, or shapes that differ.
        """
        from transformers import AutoConfig

        root = Path(path)
        model_type = check_model_dir(root)
        try:
            config = AutoConfig.from_pretrained(str(root))
        except (ValueError, TypeError, ArithmeticError, KeyError) as exc:  # transformers' own checks of the fields
            raise ValueError(f"{root / 'config.json'}: not a valid config ({type(exc).__name__}: {exc})") from None
        check_config_sizes(config, root)
        files = stored_tensors(root)
        dtype = dtype or _config_dtype(config)
        with torch.device("meta"):
            model = MODEL_TYPES[model_type]._from_config(config, dtype=dtype)  # type: ignore[attr-defined]
        model = with_moe_layers(model)  # MoE families: each sparse block a duplexpipe.moe layer, published names
        tied = {k: v for k, v in (getattr(model, "all_tied_weights_keys", None) or {}).items() if k not in files}
        opened = cls(root, model, files, tied)
        opened.check()
        return opened

    def wanted(self) -> dict[str, Tensor]:
        """Every tensor the model needs (meta), under the names of its checkpoints (MoE: every expert's own)."""
        part = causal_lm_parts(self.model, 1)[0]
        names = part_state_keys(part, 0)
        return {names[k]: t for k, t in part.state_dict(keep_vars=True).items()}

    def check(self) -> None:
        """Every tensor the model needs is in the files with its shape (an MoE checkpoint's experts one by one as
        published, or fused as transformers holds them); names the files hold that the model does not take are
        logged (transformers ignores them too)."""
        wanted = self.wanted()
        for name in wanted:
            alias = renamed_source(name, self.files) or fused_source(name, self.files)
            if self.tied.get(name, name) not in self.files and alias is not None:
                self.aliases[name] = alias
        used = {a if isinstance(a, str) else a.name for a in self.aliases.values()}
        missing = sorted(k for k in wanted if self.tied.get(k, k) not in self.files and k not in self.aliases)
        ignored = _ignored(self.model)
        unexpected = sorted(k for k in self.files if k not in wanted and k not in used and not ignored.search(k))
        if missing:
            raise ValueError(f"{self.path} does not match its config: {len(missing)} tensors missing "
                             f"({_shown(missing)}), {len(unexpected)} unexpected ({_shown(unexpected)})")
        if unexpected:
            log.warning("%s: %d tensors the model does not use are ignored (%s)", self.path, len(unexpected),
                        _shown(unexpected))
        for name, tensor in wanted.items():
            source = self._source(name)
            where = source.file if isinstance(source, StoredTensor) else f"{source.file} ({source.name})"
            if source.shape != tuple(tensor.shape):
                raise ValueError(f"{where}: {name} has shape {source.shape}, the config gives {tuple(tensor.shape)}")
            stored = self.files[source.name].dtype if isinstance(source, FusedSlice) else source.dtype
            if tensor.is_floating_point() and not stored.is_floating_point:
                raise ValueError(f"{where}: {name} is stored as {stored}, but the model's {name} holds floating-point "
                                 f"values ({tensor.dtype}); a weight file must hold it as a float")

    def _source(self, name: str) -> StoredTensor | FusedSlice:
        """Where the files hold the model's tensor `name`."""
        alias = self.aliases.get(name)
        if isinstance(alias, FusedSlice):
            return alias
        return self.files[alias if alias is not None else self.tied.get(name, name)]

    @property
    def num_layers(self) -> int:
        """Decoder layers of the model."""
        from duplexpipe.model.hf import num_layers

        return num_layers(self.model)

    def parts(self, num_parts: int, balance: Sequence[int] | None = None, *, experts: tuple[int, int] | None = None,
              bias_update_speed: float = 0.0) -> list[CausalLMPart]:
        """The model cut into `num_parts` parts on the meta device (see `causal_lm_parts`). `experts` = (ep rank,
        ep size): each MoE layer keeps only this rank's experts, so only they are allocated and read.
        `bias_update_speed`: the aux-loss-free balance of routers with an expert bias (DeepSeek-V3)."""
        parts = causal_lm_parts(self.model, num_parts, balance)
        for part in parts:
            set_bias_update_speed(part, bias_update_speed)
            if experts is not None and experts[1] > 1:
                for layer in moe_layers(part):
                    layer.shard_experts(ExpertGroup(None, *experts))
        return parts

    def partition(self, parts: Sequence[CausalLMPart], explicit: bool = False) -> Partition:
        """The Partition of `parts` (decoder layers per part, parameters, where the embedding and head are), as
        `split_model` reports it for a list of layers (`partition.txt` of `duplexpipe train`)."""
        infos = tuple(PartInfo(p.index, p.layer_ids, count_params(p), None, p.is_first, p.is_last) for p in parts)
        return Partition("explicit" if explicit else "uniform", tuple(len(p.layer_ids) for p in parts), infos)

    def fill(self, part: nn.Module, index: int) -> None:
        """A `PartInit`: fill a freshly allocated part from the files (its tensors only: under expert parallelism
        its own experts), and compute its non-persistent buffers (rotary frequencies) as transformers does."""
        init_weights: Callable[[nn.Module], None] = self.model._init_weights  # type: ignore[assignment,operator]
        for module in part.modules():
            if isinstance(module, MoELayer):
                module.reset_load()
            elif module._non_persistent_buffers_set:
                init_weights(module)
        names = part_state_keys(part, index)
        read_into([(self._source(names[local]), tensor) for local, tensor in part.state_dict().items()])


def expert_layout(mesh: Any) -> tuple[int, int] | None:
    """(ep rank, ep size) of this process in a ("pp", "edp", "ep") mesh (`make_mesh(pp, dp, ep=...)`), else None."""
    if mesh is None or "ep" not in (mesh.mesh_dim_names or ()):
        return None
    return int(mesh.get_local_rank("ep")), int(mesh.size(mesh.mesh_dim_names.index("ep")))


class TokenWeighted:
    """Turns `step(inputs, labels)`'s labels into `causal_lm_targets` over the whole batch: every counted token
    weighs the same across microbatches and (in training) data-parallel replicas, so the step's loss is
    transformers' loss of the whole batch, exact with padding."""

    def __init__(self, dp_group: Any, dp_size: int, device: torch.device, wait: Callable[[Any, str], None]) -> None:
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.device = device
        self.wait = wait

    def __call__(self, inputs: Any, targets: Any, train: bool) -> tuple[Any, Any]:
        """(inputs, token-weighted targets); targets that are not a labels tensor pass unchanged."""
        if not isinstance(targets, Tensor):
            return inputs, targets
        tokens, rows = counted_tokens(targets), int(targets.shape[0])
        if train and self.dp_size > 1:
            total = torch.tensor([tokens], dtype=torch.int64, device=self.device)
            self.wait(dist.all_reduce(total, group=self.dp_group, async_op=True), "the token-count all-reduce")
            tokens, rows = int(total.item()), rows * self.dp_size
        return inputs, causal_lm_targets(targets, tokens=tokens, rows=rows)
