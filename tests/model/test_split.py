"""Tests for duplexpipe.model.split: balancing, errors, the partition report, and (one spawn of 2 gloo ranks)
Pipeline.from_layers handing tuples, dicts and nested structures from layer to layer as nn.Sequential does."""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

from duplexpipe.errors import StructureError
from duplexpipe.model import split
from duplexpipe.model.split import (
    check_balance,
    plan_partition,
    profile_layers,
    split_model,
    uniform_balance,
)
from duplexpipe.runtime.structure import WHOLE_MESSAGE, call, flatten
from duplexpipe.schedules.registry import build, names
from duplexpipe.train.trainer import Pipeline, PipelineConfig


def _mlp(widths: list[int]) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(widths)])


def test_uniform_balance_spreads_remainder() -> None:
    assert uniform_balance(10, 4) == (3, 3, 2, 2)
    assert uniform_balance(4, 4) == (1, 1, 1, 1)


def test_params_balance_accounts_for_embedding_and_head() -> None:
    blocks = [nn.Linear(8, 8) for _ in range(6)]  # 72 params each
    embedding, head = nn.Embedding(30, 8), nn.Linear(8, 30)  # 240 and 270 params
    part = plan_partition(blocks, 3, "params", embedding=embedding, head=head)
    assert part.balance == (1, 4, 1)
    assert [p.num_params for p in part.parts] == [240 + 72, 4 * 72, 72 + 270]
    assert part.parts[0].has_embedding and part.parts[-1].has_head


class _Clock:
    """A virtual perf_counter: time moves only when a _Costly layer says it spent some."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Costly(nn.Module):
    """A Linear that costs `seconds` of virtual time per forward (so the test never depends on speed)."""

    def __init__(self, clock: _Clock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.seconds
        return self.linear(x)


def test_time_balance_follows_profiled_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(split, "time", clock)  # the profiler reads the injected clock
    torch.manual_seed(0)
    blocks = [_Costly(clock, 0.001), _Costly(clock, 0.001), _Costly(clock, 0.03)]
    part = plan_partition(blocks, 2, "time", sample_input=torch.randn(8, 64))
    assert part.balance == (2, 1), part
    assert [p.est_time_s for p in part.parts] == pytest.approx([0.002, 0.03])
    times, emb, head = profile_layers(blocks, torch.randn(4, 64))
    assert times == pytest.approx([0.001, 0.001, 0.03]) and emb == head == 0.0
    assert all(p.grad is None for b in blocks for p in b.parameters())
    cheap_last = [_Costly(clock, 0.03), _Costly(clock, 0.001), _Costly(clock, 0.001)]
    assert plan_partition(cheap_last, 2, "time", sample_input=torch.randn(8, 64)).balance == (1, 2)


def test_split_errors_name_the_values() -> None:
    model = _mlp([4, 4, 4, 4])  # 3 layers
    for balance in ("uniform", "params"):
        with pytest.raises(ValueError, match="3 layers into 4 model parts"):
            split_model(model, 4, balance)
    with pytest.raises(ValueError, match=r"balance \[1, 1\] sums to 2, but the model has 3 layers"):
        split_model(model, 2, [1, 1])
    with pytest.raises(ValueError, match=r"balance \[3\] has 1 entries, the schedule needs 2"):
        check_balance([3], 3, 2)
    with pytest.raises(ValueError, match=r"balance \[3, 0\]"):
        check_balance([3, 0], 3, 2)
    with pytest.raises(ValueError, match="unknown balance 'fast'"):
        split_model(model, 2, "fast")
    with pytest.raises(ValueError, match="sample_input"):
        split_model(model, 2, "time")


class _ReturnsNone(nn.Module):
    def forward(self, x: torch.Tensor) -> None:
        return None


def test_a_layer_returning_nothing_is_named_when_profiled() -> None:
    layers = [nn.Linear(4, 4), _ReturnsNone(), nn.Linear(4, 4)]
    with pytest.raises(StructureError, match=r"the output of layer 1 \(_ReturnsNone\) is NoneType; expected a tensor"):
        plan_partition(layers, 2, "time", sample_input=torch.zeros(2, 4))


def test_split_model_parts_compose_to_the_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(5)])
    parts, partition = split_model(model, 3, [2, 2, 1])
    x = torch.randn(3, 6)
    y = x
    for p in parts:
        y = p(y)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    assert list(parts[1].state_dict())[0] == "layer2.0.weight"
    assert [list(p.layers) for p in partition.parts] == [[0, 1], [2, 3], [4]]


def test_partition_report_is_readable_and_placed() -> None:
    blocks = [nn.Linear(4, 4) for _ in range(4)]
    parts, partition = split_model(blocks, 4, embedding=nn.Embedding(10, 4), head=nn.Linear(4, 10))
    placed = partition.placed(build("dualpipe", 4, 8))
    assert placed.parts[0].placement == ((0, 0), (4, 3))
    text = str(placed)
    assert "partition (uniform, balance [1, 1, 1, 1])" in text
    assert "0@0 4@3" in text and "+emb" in text and "+head" in text
    assert f"{placed.parts[0].num_params:,}" in text
    with pytest.raises(ValueError, match="needs 8 model parts, got 4"):
        partition.placed(build("dualpipev", 4, 8))


def test_meta_layers_split_by_params_but_not_by_time() -> None:
    with torch.device("meta"):
        blocks = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 64), nn.Linear(64, 8)]
    part = plan_partition(blocks, 2, "params", sample_input=torch.randn(2, 8))
    assert part.balance == (3, 1) and all(p.est_time_s is None for p in part.parts)
    with pytest.raises(ValueError, match="balance='time' profiles the layers, which are on the meta device"):
        plan_partition(blocks, 2, "time", sample_input=torch.randn(2, 8))


# ---------------------------------------------------------------- from_layers with several tensors between layers
# One spawn of 2 gloo ranks (conftest's `results`): every registry schedule trains layers that pass a tuple
# or a dict from one to the next, as nn.Sequential(*layers) does, against that Sequential in one process.
WORLD = 2
SPAWN_TIMEOUT_S = 180
NUM_LAYERS, WIDTH, ROWS, STEPS = 6, 4, 8, 3
"""6 layers: 2-part schedules cut after layer 2, 4-part ones after layers 1, 3 and 4."""


class _TupleLayer(nn.Module):
    """forward(self, inp) with `h, keep = inp`, returning (h, keep): keep (a float row mask without grad)
    flows forward only and changes the result."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, inp: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, keep = inp
        return h + torch.tanh(self.lin(h)) * keep, keep


class _DictLayer(nn.Module):
    """forward(self, inp) on {"h", "keep", "pos"} (pos: int64), returning the same keys."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = inp["h"] + torch.tanh(self.lin(inp["h"])) * inp["keep"] + 1e-2 * inp["pos"].unsqueeze(-1)
        return {"h": h, "keep": inp["keep"], "pos": inp["pos"]}


class _NestedLayer(_DictLayer):
    """forward(self, inp) on (h, {"keep": keep, "pos": [pos]}), a nested structure, returning the same."""

    def forward(self, inp: Any) -> Any:  # type: ignore[override]
        h, extras = inp
        out = super().forward({"h": h, "keep": extras["keep"], "pos": extras["pos"][0]})
        return out["h"], extras


class _Unpacked(nn.Module):
    """A part for Pipeline(parts): forward(self, h, extras) gets the nested message unpacked."""

    def __init__(self, layers: list[tuple[int, nn.Module]]) -> None:
        super().__init__()
        self.seq = nn.Sequential(OrderedDict((f"layer{i}", m) for i, m in layers))

    def forward(self, h: torch.Tensor, extras: dict[str, Any]) -> Any:
        return self.seq((h, extras))


def _chain_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    if isinstance(out, dict):
        h, keep = out["h"], out["keep"]
    else:
        h, keep = out[0], (out[1] if isinstance(out[1], torch.Tensor) else out[1]["keep"])
    return ((h - target) ** 2 * keep).mean()


def _chain_batch(kind: str, step: int) -> tuple[Any, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    x = torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64)
    keep = (torch.arange(ROWS) % 3 != 0).to(torch.float64).unsqueeze(-1)
    target = torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64)
    pos = torch.arange(ROWS) % 4
    nested = (x, {"keep": keep, "pos": [pos]})
    return {"tuple": (x, keep), "dict": {"h": x, "keep": keep, "pos": pos}}.get(kind, nested), target


def _chain_layers(kind: str) -> list[nn.Module]:
    torch.manual_seed(7)
    layer = {"tuple": _TupleLayer, "dict": _DictLayer}.get(kind, _NestedLayer)
    return [layer() for _ in range(NUM_LAYERS)]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


def _chain_case(name: str, kind: str) -> float:
    """The largest relative parameter difference after STEPS AdamW steps: Pipeline.from_layers vs
    nn.Sequential(*layers) in one process (this rank's stages)."""
    layers = _chain_layers(kind)
    reference = nn.Sequential(OrderedDict((f"layer{i}", copy.deepcopy(m)) for i, m in enumerate(layers)))
    ref_opt = _adamw(reference.parameters())
    options: dict[str, Any] = {}
    if name == "auto":  # a quick plan: one timed run per part on a counting clock, two candidates
        ticks = itertools.count()
        options = {"schedules": ("1f1b", "zbv"), "repeats": 1, "warmup": 0, "fit_rows": 0,
                   "fused": False, "timer": lambda: next(ticks) * 1e-3}
    sample, config = _chain_batch(kind, 0), PipelineConfig(schedule=name, num_microbatches=4, schedule_options=options)
    if kind == "unpacked":  # Pipeline(parts), parts taking (h, extras) as two arguments
        pipe = Pipeline([_Unpacked(list(enumerate(layers))[k * 3:k * 3 + 3]) for k in range(2)], _chain_loss, _adamw,
                        config)
    else:
        pipe = Pipeline.from_layers(layers, _chain_loss, _adamw, config,
                                    sample_input=sample[0] if name == "auto" else None,
                                    sample_targets=sample[1] if name == "auto" else None)
    for step in range(STEPS):
        inputs, target = _chain_batch(kind, step)
        pipe.step(inputs, target)
        ref_opt.zero_grad()
        _chain_loss(reference(inputs), target).backward()
        ref_opt.step()
    want = dict(reference.named_parameters())
    worst = 0.0
    for module in pipe.stage_state_modules.values():
        for key, param in module.named_parameters():
            ref = want[key[key.index("layer"):]]
            worst = max(worst, float((param - ref).norm() / ref.norm()))
    return worst


def _worker(rank: int, world: int) -> dict[str, Any]:
    out = {f"{name}/{kind}": _chain_case(name, kind) for name in names() for kind in ("tuple", "dict", "nested")}
    out["unpacked"] = _chain_case("1f1b", "unpacked")
    return out


@pytest.mark.parametrize("kind", ["tuple", "dict", "nested"])
@pytest.mark.parametrize("name", names())
def test_from_layers_hands_tuples_and_dicts_on_as_sequential_does(results: Any, name: str, kind: str) -> None:
    for rank, rec in enumerate(results):
        assert rec[f"{name}/{kind}"] <= 1e-10, (rank, name, kind, rec[f"{name}/{kind}"])


def test_pipeline_parts_get_a_nested_message_unpacked(results: Any) -> None:
    for rank, rec in enumerate(results):  # (h, {"keep": ..., "pos": [...]}) -> part(h, extras), across ranks
        assert rec["unpacked"] <= 1e-10, (rank, rec["unpacked"])


def test_from_layers_parts_take_the_message_whole_and_unpacked_parts_do_not() -> None:
    parts, _ = split_model(_chain_layers("tuple"), 2)
    inputs, _ = _chain_batch("tuple", 0)
    assert all(getattr(p, WHOLE_MESSAGE) for p in parts)
    form, leaves = flatten(inputs, "inputs")
    out = call(parts[1], form, leaves)  # a part behind a stage boundary gets the tuple whole
    torch.testing.assert_close(out, nn.Sequential(*parts[1])(inputs), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"stage 1: its input is a tuple of 2 tensors, passed as 2 positional "
                                        r"arguments, but _TupleLayer.forward\(inp: .*\) does not take them"):
        call(parts[1][0], form, leaves, "stage 1")  # a plain module: unpacked, and the arity does not fit


def test_time_balance_profiles_layers_that_pass_a_tuple() -> None:
    times, _, _ = profile_layers(_chain_layers("tuple"), _chain_batch("tuple", 0)[0], repeats=1)
    assert len(times) == NUM_LAYERS and all(t > 0 for t in times)
