"""A small DeepSeek-style MoE model and its one-process reference (float64), for the MoE tests."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from duplexpipe.model.split import build_parts
from duplexpipe.model.stages import inner_module
from duplexpipe.moe import CausalSelfAttention, MoEBlock, MoELayer, collect_losses, update_bias_locally

VOCAB, DIM, SEQ, HIDDEN = 13, 8, 4, 12


class Head(nn.Module):
    """Final LayerNorm and vocabulary projection."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.norm(x))


@dataclass(frozen=True)
class MoESpec:
    """How the test model is built."""

    blocks: int = 4
    experts: int = 4
    top_k: int = 2
    router: str = "softmax"
    aux: float = 0.0
    speed: float = 0.0
    shared: int = 1
    bias: tuple[float, ...] = field(default=())
    """An initial expert_bias for every layer (steers the routing), or () for zeros."""
    heads: int = 0
    """The mixer: a Linear (0), or a CausalSelfAttention with this many heads (tensor parallelism shards it)."""


def build(spec: MoESpec, seed: int = 0) -> tuple[nn.Module, list[nn.Module], nn.Module]:
    """(embedding, blocks, head) in float64."""
    torch.manual_seed(seed)
    embedding = nn.Embedding(VOCAB, DIM)
    blocks: list[nn.Module] = []
    for _ in range(spec.blocks):
        layer = MoELayer(DIM, HIDDEN, spec.experts, spec.top_k, shared_experts=spec.shared, router=spec.router,
                         aux_loss_coef=spec.aux, bias_update_speed=spec.speed)
        if spec.bias:
            layer.router.expert_bias.copy_(torch.tensor(spec.bias))
        mixer = CausalSelfAttention(DIM, spec.heads) if spec.heads else nn.Linear(DIM, DIM)
        blocks.append(MoEBlock(DIM, layer, mixer=mixer))
    head = Head()
    return embedding.double(), [b.double() for b in blocks], head.double()


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int, replica: int, rows: int = 8) -> tuple[Tensor, Tensor]:
    """Replica `replica`'s batch of `step`."""
    gen = torch.Generator().manual_seed(1000 * step + replica)
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=gen), torch.randint(0, VOCAB, (rows, SEQ), generator=gen))


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The tests' optimizer."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Plain SGD: unlike Adam, its update is off by the factor a gradient is off by."""
    return torch.optim.SGD(params, lr=0.1)


class Reference:
    """The whole model in one process with every expert, trained like a PP x DP pipeline: each replica's batch
    in M microbatches (weighted by rows), the replicas averaged, balance losses added per microbatch, the
    expert bias updated from the step's loads over every replica."""

    def __init__(self, spec: MoESpec, seed: int = 0, optimizer: Any = adamw) -> None:
        self.embedding, self.blocks, self.head = build(spec, seed)
        self.model = nn.Sequential(self.embedding, *self.blocks, self.head)
        self.optimizer = optimizer(list(self.model.parameters()))

    def step(self, step: int, replicas: int, microbatches: int) -> float:
        """One optimizer step; returns the mean loss (balance terms not included, as a Pipeline reports)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(replicas):
            tokens, targets = batch(step, r)
            rows = tokens.shape[0]
            for x, y in zip(torch.tensor_split(tokens, microbatches), torch.tensor_split(targets, microbatches),
                            strict=True):
                with collect_losses() as aux:
                    loss = loss_fn(self.model(x), y)
                weight = x.shape[0] / rows / replicas
                (weight * (loss + sum(aux, torch.zeros((), dtype=torch.float64)))).backward()
                total += weight * loss.item()
        self.optimizer.step()
        update_bias_locally(self.model)
        return total

    def parts(self, partition: Any) -> list[nn.Module]:
        """The reference's layers cut as a Pipeline's partition cut them."""
        return build_parts(self.blocks, partition, embedding=self.embedding, head=self.head)


def compare(modules: dict[int, nn.Module], groups: dict[int, int], ref_parts: Sequence[nn.Module],
            only: str = "") -> float:
    """Largest relative difference of any local parameter or buffer (experts by global index) from the
    reference part of its weight group (`only`: names containing it)."""
    worst = 0.0
    for stage, module in modules.items():
        want = dict(ref_parts[groups[stage]].named_parameters()) | dict(ref_parts[groups[stage]].named_buffers())
        got = dict(inner_module(module).named_parameters()) | dict(inner_module(module).named_buffers())
        for name, tensor in got.items():
            if name.endswith(".load") or only not in name:
                continue
            ref = want[name].detach()
            scale = max(float(ref.abs().max()), 1e-30)
            worst = max(worst, float((tensor.detach().cpu() - ref).abs().max()) / scale)
    return worst


def snapshot(modules: dict[int, nn.Module]) -> dict[str, Tensor]:
    """Every local parameter and buffer, keyed stage.name (for bit-equality across runs)."""
    return {f"{s}.{n}": t.detach().clone() for s, m in modules.items()
            for n, t in list(inner_module(m).named_parameters()) + list(inner_module(m).named_buffers())}


def copy_blocks(blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """Deep copies (a Pipeline may shard its experts in place)."""
    return [copy.deepcopy(b) for b in blocks]
