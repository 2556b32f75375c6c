"""MoELayer in one process: equal to routing each token by hand, every expert kind and router, empty
batches, bad arguments, the expert bias update, and MoEBlock."""

from __future__ import annotations

import pytest
import torch

from duplexpipe.moe import ExpertGroup, MoEBlock, MoELayer, collect_losses, update_bias_locally


def _by_hand(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    tokens = x.reshape(-1, layer.dim)
    routing = layer.router(tokens)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(layer.top_k):
            e = int(routing.experts[t, j])
            out[t] += routing.weights[t, j] * layer.experts[str(e)](tokens[t:t + 1])[0]
    if layer.shared is not None:
        out = out + layer.shared(tokens)
    return out.reshape(x.shape)


@pytest.mark.parametrize(("router", "expert", "shared"), [("softmax", "swiglu", 1), ("sigmoid", "mlp", 0),
                                                           ("sigmoid", "swiglu", 2)])
def test_equals_routing_each_token_by_hand(router: str, expert: str, shared: int) -> None:
    torch.manual_seed(0)
    layer = MoELayer(8, 12, 6, 3, shared_experts=shared, router=router, expert=expert).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(layer(x), _by_hand(layer, x), rtol=1e-12, atol=1e-12)
    layer(x).sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.experts.parameters())


def test_an_empty_batch_runs_forward_and_backward() -> None:
    layer = MoELayer(8, 12, 4, 2).double()
    x = torch.zeros(0, 8, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad is not None and x.grad.shape == (0, 8)


def test_balance_loss_is_collected_only_in_training() -> None:
    layer = MoELayer(8, 12, 4, 2, aux_loss_coef=0.1).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    with collect_losses() as aux:
        layer(x)
    assert len(aux) == 1 and aux[0].requires_grad and aux[0].item() > 0
    layer.eval()
    with collect_losses() as aux:
        layer(x)
    assert aux == []


def test_bias_update_follows_the_sign_of_the_load_gap() -> None:
    layer = MoELayer(8, 12, 4, 1, bias_update_speed=0.5).double()
    layer.load.copy_(torch.tensor([10.0, 2.0, 4.0, 4.0]))
    update_bias_locally(layer)
    assert layer.router.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]
    assert layer.load.tolist() == [0.0] * 4
    steady = MoELayer(8, 12, 4, 1).double()  # speed 0: the bias never moves
    steady.load.copy_(torch.tensor([10.0, 2.0, 4.0, 4.0]))
    update_bias_locally(steady)
    assert steady.router.expert_bias.tolist() == [0.0] * 4


def test_counts_load_in_training_forwards_only() -> None:
    layer = MoELayer(8, 12, 4, 2).double()
    layer(torch.randn(5, 8, dtype=torch.float64))
    assert layer.load.sum().item() == 10
    with torch.no_grad():
        layer(torch.randn(5, 8, dtype=torch.float64))
    assert layer.load.sum().item() == 10


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top_k": 5}, "top_k=5 is more than num_experts=4"),
    ({"top_k": 0}, "top_k must be an int >= 1, got 0"),
    ({"aux_loss_coef": -1.0}, "aux_loss_coef must be >= 0, got -1.0"),
    ({"expert": "relu"}, "expert kind must be one of"),
    ({"router": "argmax"}, "router must be one of"),
])
def test_bad_arguments_name_the_value(kwargs: dict, message: str) -> None:
    args = {"dim": 8, "hidden": 12, "num_experts": 4, "top_k": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        MoELayer(**args)


def test_sharding_keeps_this_ranks_experts_under_their_global_index() -> None:
    layer = MoELayer(8, 12, 6, 2)
    layer.shard_experts(ExpertGroup(None, 1, 3))
    assert layer.local_experts == [2, 3]
    assert sorted({k.split(".")[1] for k in layer.state_dict() if k.startswith("experts.")}) == ["2", "3"]
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the expert-parallel size ep=4"):
        MoELayer(8, 12, 6, 2).shard_experts(ExpertGroup(None, 0, 4))


def test_block_is_a_pre_norm_residual_around_mixer_and_moe() -> None:
    torch.manual_seed(0)
    block = MoEBlock(8, MoELayer(8, 12, 4, 2), mixer=torch.nn.Linear(8, 8)).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    h = x + block.mixer(block.norm1(x))
    torch.testing.assert_close(block(x), h + block.moe(block.norm2(h)))
    plain = MoEBlock(8, MoELayer(8, 12, 4, 2)).double()
    torch.testing.assert_close(plain(x), x + plain.moe(plain.norm2(x)))

