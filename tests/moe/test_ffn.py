"""Tests for duplexpipe.moe.ffn: a gated MLP expert under a family's projection names, the sigmoid-gated shared
expert, and both inside an MoELayer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from duplexpipe.moe import MoELayer, Router
from duplexpipe.moe.ffn import MIXTRAL_PROJECTIONS, GatedMLP, GatedShared


def test_gated_mlp_is_down_of_act_gate_times_up() -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(6, 10, F.gelu, MIXTRAL_PROJECTIONS).double()
    assert sorted(mlp.state_dict()) == ["w1.weight", "w2.weight", "w3.weight"]
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    want = mlp.w2(F.gelu(mlp.w1(x)) * mlp.w3(x))
    torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="three distinct projection names"):
        GatedMLP(6, 10, names=("a", "a", "b"))


def test_gated_shared_scales_by_a_sigmoid_gate() -> None:
    torch.manual_seed(0)
    shared = GatedShared(GatedMLP(6, 8), nn.Linear(6, 1, bias=False)).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(shared(x), torch.sigmoid(shared.gate(x)) * shared.expert(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one value per token, got 2"):
        GatedShared(GatedMLP(6, 8), nn.Linear(6, 2))


def test_an_moe_layer_of_given_router_experts_and_shared_module() -> None:
    torch.manual_seed(0)
    router = Router(6, 4, 2, "softmax", True, bias=False)
    layer = MoELayer(6, 8, 4, 2, router=router, expert=lambda e: GatedMLP(6, 8),
                     shared=GatedShared(GatedMLP(6, 8), nn.Linear(6, 1, bias=False))).double()
    x = torch.randn(9, 6, dtype=torch.float64)
    routing = layer.router(x)
    want = layer.shared(x).clone()
    for t in range(9):
        for k in range(2):
            e = int(routing.experts[t, k])
            want[t] += routing.weights[t, k] * layer.experts[str(e)](x[t:t + 1])[0]
    torch.testing.assert_close(layer(x), want)
    with pytest.raises(ValueError, match="the router routes to top 2 of 4 experts, the layer has top_k=1 of 4"):
        MoELayer(6, 8, 4, 1, router=Router(6, 4, 2))
    with pytest.raises(ValueError, match="bias_update_speed=0.1: the router has no expert bias"):
        MoELayer(6, 8, 4, 2, router=Router(6, 4, 2, bias=False), bias_update_speed=0.1)
