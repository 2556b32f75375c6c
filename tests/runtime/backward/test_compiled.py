"""The compiled split: the backward graph cut in two (nothing runs twice), split regions exact and honest
(I + W FLOPs == B), unsplit regions computed at I (also after a full backward donated their buffers), a weight
shared by a compiled region and an eager layer, and the refusal of a region that ran its full backward at I."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
from models import Block
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.flop_counter import FlopCounterMode

from duplexpipe.runtime.backward import compiled
from duplexpipe.runtime.backward.compiled import SplitBackend, split_graph
from duplexpipe.runtime.backward.graph import stage_backward_input, stage_backward_weight
from duplexpipe.runtime.backward.mode import BackwardMode, NodeKind, node_kind

DIM = 8


def _backward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A hand-written backward of y = tanh(x @ w.T + b): d(x), d(w), d(b)."""
    y = torch.tanh(x @ w.t() + b)
    dz = g * (1 - y * y)
    return dz @ w, dz.t() @ x, dz.sum(0)


def _blocks(compile_with: str | None, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(Block(DIM), Block(DIM), Block(DIM)).double()
    for block in model:
        if compile_with == "split":
            block.compile(backend=SplitBackend("aot_eager"))
        elif compile_with is not None:
            block.compile(backend=compile_with)
    return model


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _split_step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, int, float, float]:
    """I then W (FLOPs counted apart): (d input, parameters computed at I, I FLOPs, W FLOPs)."""
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    with FlopCounterMode(display=False) as at_i:
        dx, groups = stage_backward_input([get_gradient_edge(out)], [grad], [leaf], list(model.parameters()))
    with FlopCounterMode(display=False) as at_w:
        stage_backward_weight(groups)
    assert dx[0] is not None
    return dx[0], groups.computed_at_input, at_i.get_total_flops(), at_w.get_total_flops()


def _reference(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    model = _blocks(None)
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    with FlopCounterMode(display=False) as flops:
        out.backward(grad)
    assert leaf.grad is not None
    return leaf.grad, _grads(model), flops.get_total_flops()


def test_the_cut_puts_every_node_on_one_side_and_reproduces_the_graph() -> None:
    gm = fx.symbolic_trace(_backward)
    graphs = split_graph(gm, [False, True, True])
    i_ops = {n.target for n in graphs.i_graph.graph.nodes if n.op == "call_function"}
    assert graphs.w_graph is not None
    w_ops = [n for n in graphs.w_graph.graph.nodes if n.op in ("call_function", "call_method")]
    assert operator.matmul in i_ops and torch.tanh in i_ops
    assert all(n.target is not torch.tanh for n in w_ops), "the W graph must not redo the input path"
    assert graphs.boundary == 1  # dz: the one value both sides use
    x, w, b, g = (torch.randn(s, dtype=torch.float64) for s in ((3, 4), (5, 4), (5,), (3, 5)))
    i_out = graphs.i_graph(x, w, b, g)
    w_out = graphs.w_graph(*[(x, w, b, g)[i] for i in graphs.w_args], *i_out[1:])
    for got, want in zip((i_out[0], *w_out), _backward(x, w, b, g), strict=True):
        assert torch.equal(got, want)


def test_a_graph_without_parameters_has_no_w_graph() -> None:
    graphs = split_graph(fx.symbolic_trace(_backward), [False, False, False])
    assert graphs.w_graph is None and graphs.boundary == 0


def test_the_cut_rejects_outputs_that_do_not_match_the_inputs() -> None:
    with pytest.raises(ValueError, match="3 outputs for 2 forward inputs"):
        split_graph(fx.symbolic_trace(_backward), [False, True])


def test_nodes_say_what_they_are() -> None:
    x = torch.randn(2, DIM, dtype=torch.float64, requires_grad=True)
    kinds = {}
    for name, model in (("eager", _blocks(None)), ("split", _blocks("split")), ("unsplit", _blocks("aot_eager"))):
        kinds[name] = node_kind(model[0](x).grad_fn)
    assert kinds == {"eager": NodeKind.EAGER, "split": NodeKind.SPLIT_REGION, "unsplit": NodeKind.UNSPLIT_REGION}


@pytest.mark.parametrize("compiled", ["split", "aot_eager"])
def test_compiled_regions_split_exactly_without_recomputing(compiled: str) -> None:
    """I then W equals the eager full backward bit for bit (aot_eager runs the same kernels), and I + W cost
    the FLOPs of one backward: nothing is computed twice. A split region defers its weights (W > 0); an unsplit one
    computes them at I (W == 0), also on a second step, after a full backward compiled it with donated buffers."""
    x = torch.randn(4, 5, DIM, dtype=torch.float64)
    grad = torch.randn(4, 5, DIM, dtype=torch.float64)
    want_dx, want, full_flops = _reference(x, grad)
    model = _blocks(compiled)
    model(x.clone().requires_grad_(True)).backward(grad)  # a full backward first (donates, when it may)
    model.zero_grad(set_to_none=True)
    dx, at_input, flops_i, flops_w = _split_step(model, x, grad)
    assert torch.equal(dx, want_dx)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), want, strict=True))
    assert flops_i + flops_w == full_flops
    if compiled == "split":
        assert at_input == 0 and 0 < flops_w < full_flops
    else:
        assert at_input == len(want) and flops_w == 0


def test_an_unmarked_split_region_runs_its_full_backward() -> None:
    x = torch.randn(3, DIM, dtype=torch.float64)
    grad = torch.randn(3, DIM, dtype=torch.float64)
    want_dx, want, _ = _reference(x, grad)
    model = _blocks("split")
    leaf = x.clone().requires_grad_(True)
    model(leaf).backward(grad)
    assert leaf.grad is not None and torch.equal(leaf.grad, want_dx)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), want, strict=True))


class _Shared(nn.Module):
    """One Linear used by an eager call and inside a compiled region: its weight leaves the input path at two
    intermediates."""

    def __init__(self, compiled: str) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.region = _Region(self.lin)
        self.region.compile(backend=SplitBackend("aot_eager") if compiled == "split" else compiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.region(torch.relu(self.lin(x)))


class _Region(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("compiled", ["split", "aot_eager"])
def test_a_weight_shared_by_a_region_and_an_eager_layer_is_counted_once(compiled: str) -> None:
    torch.manual_seed(1)
    model = _Shared(compiled).double()
    ref = copy.deepcopy(model)
    ref.region._compiled_call_impl = None
    x = torch.randn(4, DIM, dtype=torch.float64)
    grad = torch.randn(4, DIM, dtype=torch.float64)
    ref(x).backward(grad)
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    _, groups = stage_backward_input([get_gradient_edge(out)], [grad], [leaf], list(model.parameters()))
    stage_backward_weight(groups)
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-13, atol=1e-13)


def test_a_split_region_that_ran_its_full_backward_at_i_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should a region ignore its mark, its weight gradients would be dropped: I raises instead."""
    model = _blocks("split")
    x = torch.randn(2, DIM, dtype=torch.float64, requires_grad=True)
    out = model(x)
    monkeypatch.setattr(compiled, "take_mode", lambda node: BackwardMode.ALL)
    with pytest.raises(RuntimeError, match="ran its full backward at I"):
        stage_backward_input([get_gradient_edge(out)], [torch.ones_like(out)], [x], list(model.parameters()))


def test_a_backward_the_cut_cannot_map_stays_one_graph_computed_at_i(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Inputs flattened another way (a tensor subclass) leave the graph uncut: the region is unsplit, still exact."""
    def refuse(gm: fx.GraphModule, is_param: list[bool]) -> None:
        raise ValueError("backward graph has 9 outputs for 7 forward inputs")

    monkeypatch.setattr(compiled, "split_graph", refuse)
    torch._dynamo.reset()  # compile anew (not from the cache of the tests above)
    x = torch.randn(3, DIM, dtype=torch.float64)
    grad = torch.randn(3, DIM, dtype=torch.float64)
    want_dx, want, _ = _reference(x, grad)
    model = _blocks("split", seed=0)
    dx, at_input, _, flops_w = _split_step(model, x, grad)
    assert node_kind(model[0](x).grad_fn) is NodeKind.UNSPLIT_REGION
    assert at_input == len(want) and flops_w == 0 and torch.equal(dx, want_dx)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), want, strict=True))
    assert "stays one graph" in caplog.text
