"""Feed-forwards for MoE layers as checkpoint families name them: a gated MLP expert with its projections under
the family's names (gate/up/down, or Mixtral's w1/w3/w2) and a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from duplexpipe.moe.linear import linear
from duplexpipe.runtime.comm_points import current_slot

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The names of a gated MLP's three projections in Qwen-MoE, DeepSeek-V3 and Llama checkpoints."""
MIXTRAL_PROJECTIONS = ("w1", "w3", "w2")
"""The same projections (gate, up, down) as Mixtral's checkpoints name them."""


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), its three bias-free projections named `names` (gate, up, down). Their weight
    gradients may be formed later, inside an F&B pair, to fill the waits for the pair's exchanges."""

    def __init__(self, dim: int, hidden: int, act: Callable[[Tensor], Tensor] = torch.nn.functional.silu,
                 names: tuple[str, str, str] = PROJECTIONS) -> None:
        super().__init__()
        if len(set(names)) != 3:
            raise ValueError(f"GatedMLP needs three distinct projection names, got {names}")
        self.names = names
        self.act = act
        for name, (fan_in, fan_out) in zip(names, ((dim, hidden), (dim, hidden), (hidden, dim)), strict=True):
            self.add_module(name, nn.Linear(fan_in, fan_out, bias=False))

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """(gate, up, down)."""
        gate, up, down = (self.get_submodule(n) for n in self.names)
        assert isinstance(gate, nn.Linear) and isinstance(up, nn.Linear) and isinstance(down, nn.Linear)
        return gate, up, down

    def forward(self, x: Tensor) -> Tensor:
        slot = current_slot()
        gate, up, down = self.projections()
        return linear(self.act(linear(x, gate, slot)) * linear(x, up, slot), down, slot)


class GatedShared(nn.Module):
    """A shared expert whose output each token scales by sigmoid(gate(x)) (Qwen2-MoE): `expert` and a Linear
    `gate` from dim to 1."""

    def __init__(self, expert: nn.Module, gate: nn.Linear) -> None:
        super().__init__()
        if gate.out_features != 1:
            raise ValueError(f"GatedShared's gate must map to one value per token, got {gate.out_features}")
        self.expert = expert
        self.gate = gate

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.expert(x)
        return torch.sigmoid(linear(x, self.gate, current_slot())) * out
