"""The default `duplexpipe train` task: a small GPT trained character-level on a bundled public-domain corpus."""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from duplexpipe.launch.train_task import TrainTask
from duplexpipe.tp.style import ScatterSequence

CORPUS_NAME = "kjv_genesis_exodus.txt"
"""The corpus file in the package's data folder (Genesis and Exodus, King James Version)."""


def corpus_text() -> str:
    """The bundled corpus (package data, so an installed wheel has it)."""
    return resources.files("duplexpipe.launch.tasks").joinpath("data", CORPUS_NAME).read_text(encoding="ascii")


@dataclass
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 73
    """Distinct characters (the corpus has 73)."""
    block_size: int = 64
    """Context length in characters."""
    d_model: int = 64
    """Width of the residual stream."""
    n_head: int = 4
    """Attention heads (d_model must be a multiple)."""
    n_layer: int = 4
    """Transformer blocks."""
    mlp_ratio: int = 4
    """MLP hidden width over d_model."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "d_model", "n_head", "n_layer", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"gpt task option {name} must be an int >= 1, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")


class Embedding(nn.Module):
    """Token plus learned position embedding: (batch, time) ids -> (batch, time, d_model)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions.

    The projections are separate (`q`, `k`, `v`, `proj`) so that tensor parallelism can shard them by columns and
    rows; heads are read as `view(b, t, -1, head_dim)`, so under TP the module sees its local heads."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the projection to character logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt_tp_plan(sequence_parallel: bool = False, *, vocab_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of the parts `Pipeline.from_layers(blocks, embedding=..., head=...)` makes of this
    GPT (children `embedding`, `layer<i>`, `head`): q, k, v and the MLP's first Linear by columns, the attention's
    and the MLP's output projections by rows. `sequence_parallel`: the LayerNorms and the residual stream hold
    1/TP of the sequence (the embedding's output is scattered, each block all-gathers before attention and MLP and
    reduce-scatters after). `vocab_parallel`: the head's projection by columns, its logits gathered (any vocabulary:
    one the TP degree does not divide is split unevenly, as `torch.chunk` splits it)."""
    rest: Placement = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "layer*.attn.q": ColwiseParallel(), "layer*.attn.k": ColwiseParallel(), "layer*.attn.v": ColwiseParallel(),
        "layer*.attn.proj": RowwiseParallel(output_layouts=rest),
        "layer*.mlp.0": ColwiseParallel(), "layer*.mlp.2": RowwiseParallel(output_layouts=rest),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True)
        plan.update({"embedding": ScatterSequence(), "layer*.ln1": SequenceParallel(), "layer*.attn": gather,
                     "layer*.ln2": SequenceParallel(), "layer*.mlp": gather})
    if vocab_parallel:
        plan["head.out"] = ColwiseParallel(input_layouts=rest, output_layouts=Replicate())
        if sequence_parallel:
            plan["head.ln"] = SequenceParallel()
    elif sequence_parallel:
        plan["head"] = gather
    return plan


def init_gpt_weights(module: nn.Module, n_layer: int) -> None:
    """GPT-2 style: matrices ~ N(0, 0.02), residual projections scaled down by sqrt(2 n_layer)."""
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            depth = math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 1.0
            nn.init.normal_(p, std=0.02 / depth)


def build_gpt(cfg: GPTConfig, seed: int = 0) -> tuple[Embedding, list[Block], Head]:
    """The model as (embedding, blocks, head), initialised from `seed` (same seed, same weights)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        embedding, blocks, head = Embedding(cfg), [Block(cfg) for _ in range(cfg.n_layer)], Head(cfg)
        for module in [embedding, *blocks, head]:
            init_gpt_weights(module, cfg.n_layer)
    finally:
        torch.random.set_rng_state(gen_state)
    return embedding, blocks, head


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-character prediction over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class CharCorpus:
    """The corpus as character ids, with deterministic random batches per step."""

    def __init__(self, text: str | None = None, val_fraction: float = 0.1) -> None:
        self.text = corpus_text() if text is None else text
        self.chars = sorted(set(self.text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor([self.index[c] for c in self.text], dtype=torch.long)
        cut = int(len(data) * (1 - val_fraction))
        self.train, self.val = data[:cut], data[cut:]

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def decode(self, ids: torch.Tensor) -> str:
        """Ids back to text."""
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, step: int, batch_size: int, block_size: int, split: str = "train",
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) windows for `step`: the same on every rank and every run."""
        data = self.train if split == "train" else self.val
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=gen)
        x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + block_size + 1] for s in starts.tolist()])
        return x, y


def gpt_task(n_layer: int = 4, d_model: int = 64, n_head: int = 4, block_size: int = 64,
             seed: int = 0) -> TrainTask:
    """The default task: a GPT over the bundled corpus with deterministic batches (`batch(step, size)`) from its
    train split and held-out ones (`eval_batch(index, size)`, for --eval-every) from its validation split."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"gpt task option seed must be an int in 0..2**63 - 1, got {seed!r}")
    corpus = CharCorpus()
    cfg = GPTConfig(vocab_size=corpus.vocab_size, block_size=block_size, d_model=d_model,
                    n_head=n_head, n_layer=n_layer)
    longest = min(len(corpus.train), len(corpus.val)) - 2  # a window and its next character fit in either split
    if block_size > longest:
        raise ValueError(f"gpt task option block_size must be <= {longest:,} (the corpus's held-out split), got "
                         f"{block_size:,}")
    embedding, blocks, head = build_gpt(cfg, seed)

    def batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return corpus.batch(step, batch_size, block_size, seed=seed)

    def eval_batch(index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return corpus.batch(index, batch_size, block_size, split="val", seed=seed)

    return TrainTask(layers=blocks, loss_fn=lm_loss, batch=batch, embedding=embedding, head=head,
                     items_per_sample=block_size, item_name="tokens", eval_batch=eval_batch, tp_plan=gpt_tp_plan)
