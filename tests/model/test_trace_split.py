"""Tests for duplexpipe.model.trace_split: traced parts compose to the whole model (one process) and
train pipelined like it (4 gloo processes, several schedules, PP x DP, meta-built)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _graph_models import DIM, SkipNet, sample
from torch import Tensor, nn
from torch.distributed.pipelining import pipe_split

from duplexpipe.launch.processes import launch
from duplexpipe.model.stages import copy_module, seeded_part
from duplexpipe.model.trace_split import GraphPart, resolve_split_points, split_module
from duplexpipe.parallel.mesh import make_mesh
from duplexpipe.train.trainer import Pipeline, PipelineConfig


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


class _CausalAttention(nn.Module):
    """Self-attention whose causal mask the forward makes with torch.ones(T, T).tril() (no device=), or with
    device=x.device."""

    def __init__(self, on_input_device: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.on_input_device = on_input_device

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        q, k, v = self.qkv(x).split(DIM, dim=-1)
        mask = (torch.ones(t, t, device=x.device) if self.on_input_device else torch.ones(t, t)).tril()
        scores = (q @ k.transpose(-2, -1)).masked_fill(mask == 0, float("-inf"))
        return x + scores.softmax(-1) @ v


class _CausalNet(nn.Module):
    def __init__(self, on_input_device: bool = False) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(_CausalAttention(on_input_device) for _ in range(4)))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


@pytest.mark.parametrize("on_input_device", [False, True])
def test_a_model_that_makes_its_causal_mask_splits_and_computes_the_same(on_input_device: bool) -> None:
    """Tracing ran the forward on the meta device, where torch.ones(T, T) (CPU) met meta activations."""
    torch.manual_seed(0)
    model = _CausalNet(on_input_device)
    x = torch.randn(2, 5, DIM)
    parts = split_module(copy.deepcopy(model), (x,), split_points="layers", num_parts=2)
    other = torch.randn(3, 5, DIM)  # another batch size: the parts are not tied to the sample's
    torch.testing.assert_close(compose(parts, other), model(other), rtol=0, atol=0)


@pytest.mark.parametrize("on_input_device", [False, True])
def test_a_meta_built_model_that_makes_its_mask_computes_the_same_once_filled(on_input_device: bool) -> None:
    """Traced on the meta device the mask is made there too; moving the parts' parameters moves it along."""
    torch.manual_seed(0)
    model = _CausalNet(on_input_device)
    with torch.device("meta"):
        meta_model = _CausalNet(on_input_device)
    x = torch.randn(2, 5, DIM)
    parts = split_module(meta_model, (x,), split_points="layers", num_parts=2)
    weights = dict(model.named_parameters())
    for part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in part.named_parameters():
                p.copy_(weights[name.removeprefix("body.")])
    torch.testing.assert_close(compose(parts, x), model(x), rtol=0, atol=0)


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


# --- pipelined training of traced parts (4 gloo processes, one launch) ----------------------------

STEPS, ROWS, MICRO = 3, 16, 2  # every microbatch has MICRO rows


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _mse(out: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, target)


def _by_name(part: nn.Module, k: int) -> None:
    """An init that goes by parameter name (traced parts keep the model's names), seeded per part."""
    with seeded_part(5, k):
        for name, p in sorted(part.named_parameters()):
            with torch.no_grad():
                p.normal_(0.0, 0.3) if name.endswith("weight") else p.uniform_(-0.1, 0.1)


def _reference(parts: list[GraphPart], steps: int) -> tuple[list[float], dict[str, Tensor]]:
    """The composed parts trained in one process on whole batches, float64."""
    parts = [copy_module(p).double() for p in parts]
    params = [p for part in parts for p in part.parameters()]
    opt = _sgd(params)
    losses = []
    for step in range(steps):
        x, mask, y = (t.double() for t in sample(ROWS, 100 + step))
        opt.zero_grad()
        loss = _mse(compose(parts, x, mask), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {f"{k}.{n}": p.detach().float() for k, part in enumerate(parts)
                    for n, p in part.named_parameters()}


def _traced_case(schedule: str, dp: int = 1, meta: bool = False) -> dict[str, Any]:
    pp = dist.get_world_size() // dp
    sample_args = sample(MICRO, 0)[:2]  # one microbatch
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = SkipNet()
    else:
        model = SkipNet()
    parts = split_module(model, sample_args, split_points="layers", num_parts=pp)
    mesh = make_mesh(pp, dp) if dp > 1 else None
    cfg = PipelineConfig(schedule, ROWS // dp // MICRO)
    pipe = Pipeline(parts, _mse, _sgd, cfg, mesh=mesh, init=_by_name if meta else None)
    losses = []
    for step in range(STEPS):
        x, mask, y = sample(ROWS, 100 + step)
        lo, hi = pipe.groups.dp_rank * ROWS // dp, (pipe.groups.dp_rank + 1) * ROWS // dp
        losses.append(pipe.step((x[lo:hi], mask[lo:hi]), y[lo:hi]))
    weights = {f"{pipe.schedule.stages[s].group}.{n}": p.detach().clone()
               for s, m in pipe.stage_modules.items() for n, p in m.named_parameters()}
    return {"losses": losses, "weights": weights}


def _traced_cases() -> dict[str, Any]:
    return {"1f1b": _traced_case("1f1b"), "dualpipe": _traced_case("dualpipe"), "zb-h1": _traced_case("zb-h1"),
            "1f1b-pp2-dp2": _traced_case("1f1b", dp=2), "meta-dualpipe": _traced_case("dualpipe", meta=True)}


@pytest.fixture(scope="module")
def traced() -> list[dict[str, Any]]:
    return launch(_traced_cases, 4, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["1f1b", "dualpipe", "zb-h1", "1f1b-pp2-dp2", "meta-dualpipe"])
def test_pipelined_training_of_traced_parts_equals_one_process(traced: list[dict[str, Any]], case: str) -> None:
    pp = 2 if "pp2" in case else 4
    torch.manual_seed(0)
    parts = split_module(SkipNet(), sample(MICRO, 0)[:2], split_points="layers", num_parts=pp)
    if case.startswith("meta"):
        for k, part in enumerate(parts):
            _by_name(part, k)
    want_losses, want_weights = _reference(parts, STEPS)
    seen = set()
    for res in traced:
        got = res[case]
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
        for name, value in got["weights"].items():
            torch.testing.assert_close(value, want_weights[name], rtol=1e-4, atol=1e-5)
            seen.add(name)
    assert seen == set(want_weights)  # every part's every weight was checked on some rank
