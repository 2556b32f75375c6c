"""The split backward's one signal: the modes, what each node is, and a node's mark moving on as it runs (I, then W,
then unmarked), for an autograd Function that reads it as compiled regions do."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

from duplexpipe.runtime.backward.graph import stage_backward_input, stage_backward_weight
from duplexpipe.runtime.backward.mode import (
    SPLITS_BACKWARD,
    BackwardMode,
    NodeKind,
    mode_of,
    node_kind,
    set_mode,
    take_mode,
)


@pytest.mark.parametrize("mode, value", [(BackwardMode.ALL, "all"), (BackwardMode.INPUTS, "inputs"),
                                         (BackwardMode.WEIGHTS, "weights")])
def test_backward_modes(mode: BackwardMode, value: Any) -> None:
    assert BackwardMode(value) is mode


class _Scale(torch.autograd.Function):
    """y = x * w, whose backward computes only what its node's mark asks for; it logs each run's mode."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, log: list[BackwardMode]) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.log = log
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        mode = take_mode(ctx)
        ctx.log.append(mode)
        dx = grad * w if mode is not BackwardMode.WEIGHTS else None
        dw = (grad * x).sum(0) if mode is not BackwardMode.INPUTS else None
        return dx, dw, None


class _SplitScale(_Scale):
    splits_backward = True


def test_a_node_is_eager_unless_its_function_reads_its_mark() -> None:
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    assert SPLITS_BACKWARD == "splits_backward"
    assert node_kind((x * w).grad_fn) is NodeKind.EAGER
    assert node_kind(_Scale.apply(x, w, []).grad_fn) is NodeKind.EAGER
    assert node_kind(_SplitScale.apply(x, w, []).grad_fn) is NodeKind.SPLIT_FUNCTION


def test_a_mark_moves_on_from_i_to_w_to_unmarked() -> None:
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    node = _SplitScale.apply(x, w, []).grad_fn
    assert mode_of(node) is BackwardMode.ALL
    set_mode(node, BackwardMode.INPUTS)
    assert take_mode(node) is BackwardMode.INPUTS and mode_of(node) is BackwardMode.WEIGHTS
    assert take_mode(node) is BackwardMode.WEIGHTS and mode_of(node) is BackwardMode.ALL
    assert take_mode(node) is BackwardMode.ALL and mode_of(node) is BackwardMode.ALL


@pytest.mark.parametrize("function", [_Scale, _SplitScale])
def test_the_split_marks_the_nodes_that_read_it(function: type[_Scale]) -> None:
    """I marks a Function that reads its mark: its I computes d(x) only, its W (the engine restarted at it) d(w) only.
    An eager Function's node is not marked: it runs B at I, and the engine drops its weight gradient (W recomputes
    it from the recorded gradient). Both end with the gradients of a full backward."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 4, dtype=torch.float64)
    leaf = x.clone().requires_grad_(True)
    (leaf * w).backward(grad)
    want_dx, want_dw = leaf.grad, w.grad
    w.grad = None
    log: list[BackwardMode] = []
    leaf = x.clone().requires_grad_(True)
    out = function.apply(leaf, w, log)
    dx, groups = stage_backward_input([get_gradient_edge(out)], [grad], [leaf], [w])
    assert w.grad is None
    stage_backward_weight(groups)
    torch.testing.assert_close(dx[0], want_dx)
    torch.testing.assert_close(w.grad, want_dw)
    split = function is _SplitScale
    assert log == ([BackwardMode.INPUTS, BackwardMode.WEIGHTS] if split else [BackwardMode.ALL, BackwardMode.ALL])
    assert mode_of(out.grad_fn) is BackwardMode.ALL
