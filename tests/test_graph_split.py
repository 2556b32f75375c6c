"""Tests for duplexpipe.pipeline.graph_split: traced parts compose to the whole model (one process)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _graph_models import DIM, SkipNet, sample
from torch import Tensor, nn
from torch.distributed.pipelining import pipe_split

from duplexpipe.pipeline.graph_split import GraphPart, resolve_split_points, split_module


def compose(parts: list[GraphPart], *args: Any, **kwargs: Any) -> Any:
    """Run the parts in order with the calling convention: tuple -> positional, dict -> keyword."""
    value = parts[0](*args, **kwargs)
    for part in parts[1:]:
        if isinstance(value, tuple):
            value = part(*value)
        elif isinstance(value, dict):
            value = part(**value)
        else:
            value = part(value)
    return value


@pytest.mark.parametrize("points", [["layers.1", "layers.3"], {"layers.1": "before", "layers.2": "after"},
                                    "layers"])
def test_parts_compose_to_the_model_with_a_residual_across_cuts(points: Any) -> None:
    torch.manual_seed(0)
    model = SkipNet()
    x, mask, _ = sample(6, 1)
    want = model(x, mask)
    parts = split_module(copy.deepcopy(model), (x, mask), split_points=points, num_parts=3)
    assert len(parts) == 3
    mid = parts[0](x, mask)
    assert isinstance(mid, tuple) and len(mid) == 3  # the running sum, the skip and the mask flow on
    torch.testing.assert_close(compose(parts, x, mask), want, rtol=0, atol=0)
    other_x, other_mask, _ = sample(6, 2)  # the parts are not tied to the sample's values
    torch.testing.assert_close(compose(parts, other_x, other_mask), model(other_x, other_mask), rtol=0, atol=0)
    total = sum(p.numel() for part in parts for p in part.parameters())
    assert total == sum(p.numel() for p in model.parameters())


def test_gradients_through_the_parts_equal_the_models() -> None:
    torch.manual_seed(0)
    model = SkipNet()
    parts = split_module(copy.deepcopy(model), sample(4, 0)[:2], split_points=["layers.2"])
    x, mask, target = sample(4, 3)
    nn.functional.mse_loss(model(x, mask), target).backward()
    nn.functional.mse_loss(compose(parts, x, mask), target).backward()
    got = {n.removeprefix("body."): p.grad for part in parts for n, p in part.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-6, atol=1e-7)


class _Marked(nn.Module):
    """Cuts marked in forward with pipe_split(); keyword input; dict output using an early value."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, *, scale: Tensor) -> dict[str, Tensor]:
        h = self.a(x) * scale
        pipe_split()
        return {"y": self.b(h), "h": h}


def test_pipe_split_markers_keyword_inputs_and_dict_outputs() -> None:
    torch.manual_seed(0)
    model = _Marked()
    x, scale = torch.randn(3, 4), torch.rand(3, 1)
    parts = split_module(model, (x,), {"scale": scale})
    assert len(parts) == 2
    got = compose(parts, x=x, scale=scale)
    want = model(x, scale=scale)
    assert isinstance(got, dict) and sorted(got) == ["h", "y"]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    assert not hasattr(model.a, "_orig_forward")


def test_meta_model_splits_into_meta_parts() -> None:
    with torch.device("meta"):
        model = SkipNet()
    parts = split_module(model, sample(4, 0)[:2], split_points="layers", num_parts=2)
    assert len(parts) == 2
    assert all(p.is_meta for part in parts for p in part.parameters())
    assert "layers.0.lin.weight" in dict(parts[0].body.named_parameters())


def test_split_point_errors_name_the_value() -> None:
    model = SkipNet()
    with pytest.raises(ValueError, match="split point 'layers.9' names no submodule of SkipNet"):
        resolve_split_points(model, ["layers.9"], None)
    with pytest.raises(ValueError, match="'middle' must be 'before' or 'after'"):
        resolve_split_points(model, {"layers.1": "middle"}, None)
    with pytest.raises(ValueError, match="'inp' must name a ModuleList or Sequential"):
        resolve_split_points(model, "inp", 2)
    with pytest.raises(ValueError, match="needs num_parts"):
        resolve_split_points(model, "layers", None)
    with pytest.raises(ValueError, match="cannot split 4 layers into 5 model parts"):
        resolve_split_points(model, "layers", 5)
    parts = split_module(SkipNet(), sample(2, 0)[:2], split_points=["layers.1"])
    with pytest.raises(TypeError, match=r"model part 0 is missing inputs \['mask'\]"):
        parts[0](torch.randn(2, DIM))
