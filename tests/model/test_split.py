"""Tests for duplexpipe.model.split: balancing, errors and the partition report."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from duplexpipe.model import split
from duplexpipe.model.split import (
    check_balance,
    plan_partition,
    profile_layers,
    split_model,
    uniform_balance,
)
from duplexpipe.schedules.registry import build


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
