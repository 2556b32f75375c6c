"""The benchmark models, built as a list of model parts with a deterministic init."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark workload: which model, how big, and the batch it trains on."""

    kind: str
    """"mlp", "transformer" or "sleep"."""
    num_layers: int = 8
    """Blocks in the whole model; they are dealt evenly to the model parts."""
    width: int = 256
    """Hidden size (MLP width, transformer d_model, sleep model feature size)."""
    batch: int = 64
    """Samples per step (split into microbatches)."""
    seq: int = 32
    """Sequence length (transformer only)."""
    heads: int = 4
    """Attention heads (transformer only)."""
    sleep_ms: tuple[float, float, float] = (20.0, 20.0, 20.0)
    """Sleep model only: milliseconds slept per part in forward, input-backward, weight-backward."""
    seed: int = 0
    """Seed of the parameter init and of the data."""

    def describe(self) -> str:
        """A one-line human description."""
        if self.kind == "mlp":
            return f"{self.num_layers} x (Linear {self.width} + ReLU), batch {self.batch}"
        if self.kind == "transformer":
            return (f"{self.num_layers} transformer layers, d_model {self.width}, {self.heads} heads, "
                    f"seq {self.seq}, batch {self.batch}")
        f, i, w = self.sleep_ms
        return (f"sleep model: F/I/W = {f:g}/{i:g}/{w:g} ms per part, {self.width} features, "
                f"batch {self.batch}")


class _SleepFI(torch.autograd.Function):
    """Identity that sleeps `f` seconds in forward and `i` seconds in its (input) backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, i: float) -> torch.Tensor:
        ctx.i = i
        time.sleep(f)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.i)
        return grad, None, None


class _SleepW(torch.autograd.Function):
    """Identity on a parameter that sleeps `w` seconds when its gradient is computed."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, w: float) -> torch.Tensor:
        ctx.w = w
        return p.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.w)
        return grad, None


class SleepPart(nn.Module):
    """y = x + bias with fixed sleeps: F in forward, I on the input path, W on the weight path.

    The bias path does not lie on the input-gradient path, so an input-only backward (I)
    sleeps `i` and a weight-only backward (W) sleeps `w`; a full backward sleeps both.
    """

    def __init__(self, width: int, f_s: float, i_s: float, w_s: float) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(width) * 0.01)
        self.f_s, self.i_s, self.w_s = f_s, i_s, w_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepFI.apply(x, self.f_s, self.i_s) + _SleepW.apply(self.bias, self.w_s)


def _mlp_block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


def _transformer_block(spec: ModelSpec) -> nn.Module:
    return nn.TransformerEncoderLayer(spec.width, spec.heads, dim_feedforward=4 * spec.width,
                                      dropout=0.0, batch_first=True)


def build_parts(spec: ModelSpec, num_parts: int) -> list[nn.Module]:
    """The model as `num_parts` consecutive parts, identical on every process for one spec."""
    if spec.kind == "sleep":
        f, i, w = (ms / 1000.0 for ms in spec.sleep_ms)
        torch.manual_seed(spec.seed)
        return [SleepPart(spec.width, f, i, w) for _ in range(num_parts)]
    if spec.num_layers % num_parts:
        raise ValueError(f"{spec.num_layers} layers do not split evenly into {num_parts} parts")
    torch.manual_seed(spec.seed)
    if spec.kind == "mlp":
        blocks = [_mlp_block(spec.width) for _ in range(spec.num_layers)]
    elif spec.kind == "transformer":
        blocks = [_transformer_block(spec) for _ in range(spec.num_layers)]
    else:
        raise ValueError(f"unknown model kind {spec.kind!r}; expected mlp, transformer or sleep")
    per = spec.num_layers // num_parts
    return [nn.Sequential(*blocks[k * per:(k + 1) * per]) for k in range(num_parts)]


def make_batch(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for one step, the same on every process."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    shape = (spec.batch, spec.seq, spec.width) if spec.kind == "transformer" else (spec.batch, spec.width)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-microbatch loss: mean squared error."""
    return nn.functional.mse_loss(output, target)


def reference_grads(parts: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
                    num_microbatches: int, loss: Callable[..., torch.Tensor] = loss_fn,
                    ) -> tuple[list[list[torch.Tensor]], float]:
    """Single-process gradients of the mean over microbatches of loss(mb); returns (grads per part, loss)."""
    model = nn.Sequential(*copy.deepcopy(parts))
    model.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in zip(inputs.tensor_split(num_microbatches), targets.tensor_split(num_microbatches),
                    strict=True):
        value = loss(model(x), y) / num_microbatches
        value.backward()
        total += float(value.detach())
    grads = [[p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
              for p in part.parameters()] for part in model]
    return grads, total


def part_grads(module: nn.Module) -> list[torch.Tensor]:
    """The gradients of one part's parameters (zeros where a gradient is missing)."""
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in module.parameters()]


def max_rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max |got - want| / max(|want|, tiny) over all tensors of a part."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = max(float(w.abs().max()), 1e-12)
        worst = max(worst, float((g - w).abs().max()) / scale)
    return worst
