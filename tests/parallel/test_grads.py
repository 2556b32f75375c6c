"""Tests for duplexpipe.parallel.grads (single process; the cross-rank paths run in test_trainer)."""

from __future__ import annotations

import math

import torch
from torch import nn

from duplexpipe.parallel.grads import (
    clip_factor,
    ensure_grads,
    global_norm_and_overflow,
    scale_grads,
)


def test_norm_counts_only_the_counted_grads_and_flags_overflow() -> None:
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    norm, overflow = global_norm_and_overflow([a], [a, b], None, torch.device("cpu"))
    assert norm == 5.0 and not overflow
    norm, overflow = global_norm_and_overflow([a, b], [a, b], None, torch.device("cpu"))
    assert norm == 13.0
    norm, overflow = global_norm_and_overflow([a], [a, torch.tensor([math.inf])], None, torch.device("cpu"))
    assert overflow and norm == 5.0
    _, overflow = global_norm_and_overflow([], [torch.tensor([math.nan])], None, torch.device("cpu"))
    assert overflow


def test_clip_factor_matches_torch() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    layer(torch.randn(2, 4)).sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    total = torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.1)
    norm, _ = global_norm_and_overflow(grads, grads, None, torch.device("cpu"))
    assert abs(norm - total.item()) < 1e-6
    for g in grads:
        g.mul_(clip_factor(norm, 0.1))
    for g, p in zip(grads, layer.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)
    assert clip_factor(0.5, None) == 1.0 and clip_factor(0.5, 1.0) == 1.0


def test_ensure_and_scale_grads() -> None:
    layer = nn.Linear(2, 2)
    grads = ensure_grads(layer.parameters())
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    layer.weight.grad.fill_(2.0)
    scale_grads(layer.parameters(), 0.25)
    assert torch.equal(layer.weight.grad, torch.full((2, 2), 0.5))


def test_a_flag_raised_earlier_counts_as_overflow() -> None:
    a = torch.tensor([3.0, 4.0])
    norm, overflow = global_norm_and_overflow([a], [], None, torch.device("cpu"), flagged=True)
    assert overflow and norm == 5.0
    _, overflow = global_norm_and_overflow([a], [], None, torch.device("cpu"), flagged=torch.tensor(False))
    assert not overflow


def test_a_finite_gradient_beyond_float32_squares_is_not_an_overflow() -> None:
    huge = torch.full((4,), 1e30)  # its sum of squares overflows float32; the norm is finite
    norm, overflow = global_norm_and_overflow([huge], [huge, torch.ones(2, dtype=torch.bfloat16)], None,
                                              torch.device("cpu"))
    assert not overflow and math.isclose(norm, 2e30, rel_tol=1e-6)
    a = torch.tensor([3.0, 4.0], dtype=torch.float64)
    norm, overflow = global_norm_and_overflow([a, a], [a], None, torch.device("cpu"))  # counted twice: twice
    assert math.isclose(norm, 50**0.5) and not overflow
