"""The graph split (stage_backward_input, stage_backward_weight): exact gradients on plain modules, and an honest W
that never redoes the input path."""

from __future__ import annotations

import copy

import pytest
import torch
from models import Block
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.flop_counter import FlopCounterMode

from duplexpipe.runtime.backward.graph import stage_backward_input, stage_backward_weight

DIM = 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


class Tied(nn.Module):
    """One Linear applied twice: its weight leaves the input path at two intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


class PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _models() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    return {
        "mlp blocks": (nn.Sequential(Block(DIM), Block(DIM)), (4, DIM)),
        "attention": (nn.Sequential(Attention(), Block(DIM)), (2, 5, DIM)),
        "tied weight": (Tied(), (3, DIM)),
        "unused parameter": (PartlyUsed(), (3, DIM)),
    }


def _full(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, needs_input: bool
          ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    leaf = x.clone().requires_grad_(needs_input)
    model(leaf).backward(grad)
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()], leaf.grad


@pytest.mark.parametrize("needs_input", [True, False], ids=["middle stage", "first stage"])
@pytest.mark.parametrize("name", list(_models()))
def test_input_then_weight_equals_full_backward(name: str, needs_input: bool) -> None:
    model, shape = _models()[name]
    model = model.double()
    x = torch.randn(shape, dtype=torch.float64)
    grad = torch.randn_like(model(x))
    want, want_dx = _full(copy.deepcopy(model), x, grad, needs_input)
    leaf = x.clone().requires_grad_(needs_input)
    out = model(leaf)
    dinputs, groups = stage_backward_input([get_gradient_edge(out)], [grad], [leaf], list(model.parameters()))
    assert all(p.grad is None for p in model.parameters()), "I must not compute weight gradients"
    if needs_input:
        assert dinputs[0] is not None and want_dx is not None
        torch.testing.assert_close(dinputs[0], want_dx, rtol=1e-12, atol=1e-12)
    else:
        assert dinputs == [None]
    stage_backward_weight(groups)
    for p, w in zip(model.parameters(), want, strict=True):
        if w is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, w, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="already been computed"):
        stage_backward_weight(groups)


def test_weight_gradients_accumulate_into_existing_grad() -> None:
    model = nn.Linear(DIM, DIM).double()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    x = torch.randn(3, DIM, dtype=torch.float64, requires_grad=True)
    out = model(x)
    _, groups = stage_backward_input([get_gradient_edge(out)], [torch.ones_like(out)], [x], list(model.parameters()))
    stage_backward_weight(groups)
    torch.testing.assert_close(model.bias.grad, 1 + torch.full((DIM,), 3.0, dtype=torch.float64))


@pytest.mark.parametrize("name", ["mlp blocks", "attention"])
def test_w_costs_only_the_weight_matmuls(name: str) -> None:
    """FLOPs: I + W == B, and W is well below B (it does not redo the full backward)."""
    model, shape = _models()[name]
    x = torch.randn(shape)
    grad = torch.randn_like(model(x))
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    with FlopCounterMode(display=False) as full:
        out.backward(grad)
    out = model(leaf)
    with FlopCounterMode(display=False) as flops_i:
        _, groups = stage_backward_input([get_gradient_edge(out)], [grad], [leaf], list(model.parameters()))
    with FlopCounterMode(display=False) as flops_w:
        stage_backward_weight(groups)
    total = full.get_total_flops()
    assert flops_i.get_total_flops() + flops_w.get_total_flops() == total
    assert 0 < flops_w.get_total_flops() < total


def test_w_never_runs_input_path_nodes_again() -> None:
    """The GELU and LayerNorm-input nodes run once (in I); W only revisits the param groups' intermediates."""
    model = nn.Sequential(Block(DIM), Block(DIM))
    leaf = torch.randn(4, DIM, requires_grad=True)
    out = model(leaf)
    counts: dict[str, int] = {}
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = node.name()
        if "Gelu" in name:
            node.register_prehook(lambda g, n=name: counts.__setitem__(n, counts.get(n, 0) + 1))
        stack.extend(child for child, _ in node.next_functions)
    _, groups = stage_backward_input([get_gradient_edge(out)], [torch.ones_like(out)], [leaf],
                             list(model.parameters()))
    after_i = dict(counts)
    stage_backward_weight(groups)
    assert after_i and counts == after_i, (after_i, counts)


def test_first_stage_defers_its_full_backward_to_w() -> None:
    """Inputs without gradient: I computes nothing, W is the full backward, run once (its graph is then freed)."""
    model, shape = _models()["mlp blocks"]
    x = torch.randn(shape)
    grad = torch.randn_like(model(x))
    want, _ = _full(copy.deepcopy(model), x, grad, False)
    out = model(x)
    with FlopCounterMode(display=False) as flops_i:
        dinputs, groups = stage_backward_input([get_gradient_edge(out)], [grad], [x], list(model.parameters()))
    assert dinputs == [None] and flops_i.get_total_flops() == 0
    stage_backward_weight(groups)
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w)
    with pytest.raises(RuntimeError, match="second time"):
        out.backward(grad)


def test_split_follows_a_parameter_whose_accumulator_was_replaced() -> None:
    """A dtype change between two forwards gives every parameter a new gradient accumulator: the split reads the one
    the new graph uses (a stale one would leave the parameters out of W and drop their gradients)."""
    model, shape = _models()["attention"]
    before: list[object] = []
    for dtype in (torch.float32, torch.float64):
        model = model.to(dtype)
        nodes = [get_gradient_edge(p).node for p in model.parameters()]
        assert not any(a is b for a, b in zip(before, nodes, strict=False)), "the accumulators were not replaced"
        before = nodes
        model.zero_grad(set_to_none=True)
        x = torch.randn(shape, dtype=dtype)
        grad = torch.randn_like(model(x))
        want, want_dx = _full(copy.deepcopy(model), x, grad, True)
        leaf = x.clone().requires_grad_(True)
        out = model(leaf)
        dinputs, groups = stage_backward_input([get_gradient_edge(out)], [grad], [leaf], list(model.parameters()))
        stage_backward_weight(groups)
        torch.testing.assert_close(dinputs[0], want_dx)
        for p, w in zip(model.parameters(), want, strict=True):
            assert p.grad is not None and p.grad.dtype == dtype
            torch.testing.assert_close(p.grad, w)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_first_stage_w_adds_to_existing_grads_as_b_does() -> None:
    """W of a first stage (the full backward, its gradients added in the engine call) leaves every .grad exactly as B
    leaves it, onto gradients already there (float64); a parameter that is not a leaf gets its gradient and its leaf
    none (the engine never runs on past it)."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(DIM), Block(DIM)).double()
    reference = copy.deepcopy(model)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    x = torch.randn(4, DIM, dtype=torch.float64)
    grad = torch.randn(4, DIM, dtype=torch.float64)
    reference(x).backward(grad)
    out = model(x)
    _, groups = stage_backward_input([get_gradient_edge(out)], [grad], [x], list(model.parameters()))
    stage_backward_weight(groups)
    for p, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert want.grad is not None
        torch.testing.assert_close(p.grad, want.grad, rtol=0, atol=0)

    leaf = torch.randn(DIM, DIM, dtype=torch.float64, requires_grad=True)
    weight = leaf * 2  # the stage's "parameter" is computed from a leaf
    x = torch.randn(3, DIM, dtype=torch.float64)
    out = x @ weight
    _, groups = stage_backward_input([get_gradient_edge(out)], [torch.ones_like(out)], [x], [weight])
    stage_backward_weight(groups)
    torch.testing.assert_close(weight.grad, x.t() @ torch.ones_like(out))
    assert leaf.grad is None
