"""Tests for duplexpipe.parallel.sharded_optimizer in one process (no group: the shard is the whole buffer):
stepping flat buffers equals stepping the tensors, param groups keep their hyperparameters, and optimizers
not known to be elementwise are refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from duplexpipe.parallel.sharded_optimizer import ELEMENTWISE_OPTIMIZERS, ShardedOptimizer, check_elementwise

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 33), nn.LayerNorm(33), nn.Linear(33, 5))


def _groups(cls: type[torch.optim.Optimizer], **kw: float) -> Factory:
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return cls([{"params": [p for p in params if p.dim() > 1]},
                    {"params": [p for p in params if p.dim() == 1], "lr": 0.003}], **kw)  # type: ignore[arg-type]
    return make


FACTORIES = {
    "adamw": _groups(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": _groups(torch.optim.Adam, lr=1e-2, amsgrad=True),
    "sgd_nesterov": _groups(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adagrad": _groups(torch.optim.Adagrad, lr=0.1),
    "rmsprop": _groups(torch.optim.RMSprop, lr=1e-2, momentum=0.5),
}


def _grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=gen) * 10.0 ** (step % 3 - 1) for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_stepping_the_flat_buffers_equals_stepping_each_tensor_bit_for_bit(name: str) -> None:
    make = FACTORIES[name]
    ref, flat = _model(), _model()
    ref_opt = make(list(ref.parameters()))
    names = {id(p): (0, f"stage0.{n}") for n, p in flat.named_parameters()}
    sharded = ShardedOptimizer(make(list(flat.parameters())), names, None)
    assert [len(f.params) for f in sharded.flats] == [2, 4]  # weights; biases and LayerNorm's
    for step in range(4):
        for p, g in zip(ref.parameters(), _grads(ref, step), strict=True):
            p.grad = g.clone()
        for p, g in zip(flat.parameters(), _grads(flat, step), strict=True):
            p.grad = g.clone()
        ref_opt.step()
        for f in sharded.flats:
            sharded.start(f)
        sharded.finish()
        sharded.step()
        sharded.zero_grad()
        assert all(p.grad is None for p in flat.parameters())
    for a, b in zip(ref.parameters(), flat.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert [g["lr"] for g in sharded.optimizer.param_groups] == [g["lr"] for g in ref_opt.param_groups]


def test_parameters_become_views_into_the_flat_buffer_with_their_values() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    names = {id(p): (0, n) for n, p in model.named_parameters()}
    sharded = ShardedOptimizer(torch.optim.SGD(list(model.parameters()), lr=0.1), names, None)
    (flat,) = sharded.flats
    for p, want, lo in zip(model.parameters(), before, flat.layout.offsets, strict=False):
        assert torch.equal(p, want)
        assert p.data_ptr() == flat.data[lo:].data_ptr()
    assert flat.master.data_ptr() == flat.data.data_ptr()  # no qwZ: the master is a view, not a copy
    other = _model()
    own = ShardedOptimizer(torch.optim.SGD(list(other.parameters()), lr=0.1),
                           {id(p): (0, n) for n, p in other.named_parameters()}, None, own_master=True)
    (flat,) = own.flats
    assert flat.master.data_ptr() != flat.data.data_ptr() and torch.equal(flat.master, flat.data)


def test_only_known_elementwise_optimizers_are_accepted() -> None:
    model = _model()
    for cls in ELEMENTWISE_OPTIMIZERS:
        check_elementwise(cls(list(model.parameters()), lr=0.1))
    lbfgs = torch.optim.LBFGS(list(model.parameters()))
    with pytest.raises(ValueError, match="got LBFGS .*trust_elementwise=True"):
        ShardedOptimizer(lbfgs, {id(p): (0, n) for n, p in model.named_parameters()}, None)
    check_elementwise(lbfgs, trusted=True)


def test_a_parameter_outside_the_stages_is_refused() -> None:
    model, other = _model(), nn.Linear(2, 2)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    with pytest.raises(ValueError, match="not in this rank's stages"):
        ShardedOptimizer(opt, {id(p): (0, n) for n, p in model.named_parameters()}, None)
