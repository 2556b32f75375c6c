"""SavedBytes: what autograd keeps for backward, parameters excluded, each storage counted once."""

from __future__ import annotations

import torch
from torch import nn

from duplexpipe.runtime.saved_bytes import SavedBytes, storage_key


def test_linear_keeps_its_input_but_not_its_weight() -> None:
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedBytes(layer.parameters())
    with meter.counting():
        layer(x)
    assert meter.total == 4 * 8 * 4  # the input; weight.t() is a view of a parameter


def test_relu_output_adds_and_reset_starts_over() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    meter = SavedBytes(model.parameters())
    with meter.counting():
        model(torch.randn(4, 8, requires_grad=True))
    assert meter.total == 2 * 128
    meter.reset()
    assert meter.total == 0
    with meter.counting():
        model(torch.randn(2, 8, requires_grad=True))
    assert meter.total == 2 * 64


def test_a_storage_saved_twice_or_through_a_view_counts_once_and_whole() -> None:
    x = torch.randn(16, requires_grad=True)
    base = x * 1.0  # a fresh 64-byte storage
    meter = SavedBytes()
    with meter.counting():
        (base * base).sum()  # saves `base` twice
        (base[:4] * 2.0 * base[:4]).sum()  # saves views of `base`, and one fresh 16-byte tensor
    assert meter.total == 64 + 16


def test_nothing_is_counted_outside_the_block_and_the_innermost_hooks_count() -> None:
    meter, outer = SavedBytes(), SavedBytes()
    x = torch.randn(8, requires_grad=True)
    (x * x).sum()
    with outer.counting(), meter.counting():
        (x.exp()).sum()
    assert meter.total == 32 and outer.total == 0
    assert storage_key(x)[1] == 32
