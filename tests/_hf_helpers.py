"""Tiny transformers causal LMs (random init from configs, no download) and data for the hf tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, SEQ = 96, 8
_SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=64)


def _seeded(build: Any, seed: int) -> nn.Module:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model: nn.Module = build()
    finally:
        torch.random.set_rng_state(state)
    return model


def tiny_llama(layers: int = 8, seed: int = 0, attn: str = "sdpa", **overrides: Any) -> nn.Module:
    """A LlamaForCausalLM with hidden size 32 (grouped-query attention: 4 heads, 2 KV heads)."""
    cfg = transformers.LlamaConfig(**{**_SMALL, "num_hidden_layers": layers, **overrides},
                                   attn_implementation=attn)
    return _seeded(lambda: transformers.LlamaForCausalLM(cfg), seed)


def tiny_mistral(layers: int = 4, seed: int = 0, window: int | None = 4) -> nn.Module:
    """A MistralForCausalLM whose sliding window is shorter than the test sequences."""
    cfg = transformers.MistralConfig(**_SMALL, num_hidden_layers=layers, sliding_window=window,
                                     attn_implementation="sdpa")
    return _seeded(lambda: transformers.MistralForCausalLM(cfg), seed)


def tiny_qwen2(layers: int = 4, seed: int = 0) -> nn.Module:
    """A Qwen2ForCausalLM with full-attention layers first and sliding-window layers after."""
    cfg = transformers.Qwen2Config(**_SMALL, num_hidden_layers=layers, use_sliding_window=True, sliding_window=4,
                                   max_window_layers=layers // 2, attn_implementation="eager")
    return _seeded(lambda: transformers.Qwen2ForCausalLM(cfg), seed)


def tiny_qwen3(layers: int = 4, seed: int = 0) -> nn.Module:
    """A Qwen3ForCausalLM (per-head q/k norms in the attention)."""
    cfg = transformers.Qwen3Config(**_SMALL, num_hidden_layers=layers, head_dim=8, attn_implementation="sdpa")
    return _seeded(lambda: transformers.Qwen3ForCausalLM(cfg), seed)


def tiny_gpt2(layers: int = 8, seed: int = 0, **overrides: Any) -> nn.Module:
    """A GPT2LMHeadModel (head tied to the token embedding unless overridden), dropout off."""
    cfg = transformers.GPT2Config(**{"n_layer": layers, "n_embd": 32, "n_head": 4, "vocab_size": VOCAB,
                                     "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                     "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0, **overrides})
    return _seeded(lambda: transformers.GPT2LMHeadModel(cfg), seed)


BUILDERS = {"llama": tiny_llama, "llama-eager": lambda **kw: tiny_llama(attn="eager", **kw),
            "mistral": tiny_mistral, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "gpt2": tiny_gpt2}
"""Every supported architecture, by test id."""


def token_batch(step: int, rows: int = 8, seq: int = SEQ) -> tuple[Tensor, Tensor]:
    """Random token ids (rows, seq) and the labels `model(ids, labels=labels)` takes (the ids)."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    return ids, ids.clone()


def padding_mask(rows: int, seq: int = SEQ, left: bool = True) -> Tensor:
    """A mask (1 real, 0 padding) with right padding, a hole inside a row and, if `left`, left padding."""
    mask = torch.ones(rows, seq, dtype=torch.long)
    for r in range(rows):
        kind = r % 3
        if kind == 1:
            mask[r, seq - 1 - r % (seq // 2):] = 0  # right padding of varying length
        elif kind == 2:
            mask[r, 2:4] = 0  # a hole
        elif left and r:
            mask[r, :2] = 0  # left padding (fully masked query rows)
    return mask


def padded_labels(ids: Tensor, mask: Tensor) -> Tensor:
    """Labels with -100 where the mask pads: rows then count different numbers of tokens."""
    return ids.masked_fill(mask == 0, -100)


def lm_batch(step: int, rows: int, padded: bool) -> tuple[Any, Tensor]:
    """(inputs, labels) of `step`: with padding, an attention mask and -100 labels (rows count unequal tokens)."""
    ids, labels = token_batch(step, rows=rows)
    if not padded:
        return ids, labels
    mask = padding_mask(rows, left=False)
    return {"input_ids": ids, "attention_mask": mask}, padded_labels(ids, mask)


def adamw(params: list[nn.Parameter], lr: float = 1e-2) -> torch.optim.Optimizer:
    """The optimizer of the fine-tuning tests: AdamW with weight decay 0.01."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def train_transformers(model: nn.Module, steps: int, rows: int, padded: bool) -> list[float]:
    """`steps` of plain transformers training in one process on `lm_batch`, next-token cross entropy over the batch in
    float64 (transformers' own loss casts float64 logits to float32, so the reference computes it itself)."""
    optimizer = adamw(list(model.parameters()))
    losses = []
    for step in range(steps):
        inputs, labels = lm_batch(step, rows, padded)
        kwargs = inputs if isinstance(inputs, dict) else {"input_ids": inputs}
        logits = model(**kwargs).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].reshape(-1), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def file_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a model directory's safetensors files, read directly."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return out


def run_parts(parts: list[nn.Module], inputs: Any) -> Any:
    """Compose the parts as the runtime calls them: a dict as keywords, a tuple as positions."""
    x = inputs
    for part in parts:
        x = part(**x) if isinstance(x, dict) else part(*x) if isinstance(x, tuple) else part(x)
    return x


def rel(got: Tensor, want: Tensor) -> float:
    """Norm-wise relative error in float64."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def char_tokenizer(text: str) -> Any:
    """A character-level fast tokenizer over `text`'s characters (ids below VOCAB), built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = sorted(set(text))
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    assert len(vocab) <= VOCAB, len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def eos_tokenizer(text: str, eos: str = "</s>") -> Any:
    """A character-level fast tokenizer over `text` with an end-of-sequence token `eos`, built offline as a user would
    (tokenizers' WordLevel model, saved by transformers' PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, eos: 1, **{c: i + 2 for i, c in enumerate(sorted(set(text)))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos)


def peak_bytes(fn: Any, mapped: frozenset[int] = frozenset()) -> tuple[Any, int]:
    """fn()'s result and the most CPU bytes torch's allocator held at once while it ran (the profiler's memory
    events, counted from zero at the start). Storages of a size in `mapped` are file mappings (the safetensors
    library maps a file and touches only the pages of the tensors read): not counted."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        if abs(event.nbytes()) in mapped:
            continue
        live += event.nbytes()
        peak = max(peak, live)
    return result, peak


def file_sizes(folder: Any) -> frozenset[int]:
    """The sizes of a model folder's safetensors files (what `peak_bytes` leaves out as file mappings)."""
    return frozenset(p.stat().st_size for p in folder.glob("*.safetensors"))


def own_bytes(pipe: Any) -> tuple[int, int]:
    """(bytes of a pipeline's parameters and buffers on this rank, the largest single tensor among them)."""
    tensors = {id(t): t for m in pipe.stage_state_modules.values() for t in [*m.parameters(), *m.buffers()]}
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    return sum(sizes), max(sizes)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside the block: tiny MoE models' index_add_ and softmax otherwise wait on OpenMP's
    thread team for tens of milliseconds a call on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
