"""Measured memory per step: the report's kinds and peaks, and its activation peak against the simulator's, 4 ranks.

`python tests/runtime/test_measured_memory.py` prints the measured-vs-predicted table (run from the repository root
with the tests folder on PYTHONPATH)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.runtime.memory import MemoryPoint, MemoryReport, optimizer_bytes, storages

WORLD = 4
SPAWN_TIMEOUT_S = 240
SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev")
ROWS, WIDTH, M = 4, 16, 8
UNIT = ROWS * WIDTH * 4
"""Bytes of one (rows x width) float32 activation."""
SAVED = 2 * UNIT
"""By hand, what one microbatch's forward keeps for backward on every stage: the first part (Tanh, Linear, Tanh,
Linear) keeps both Tanh outputs (the first Linear saves the first's; the batch is the caller's); every other part
(Linear, Tanh, Linear) keeps its input leaf (also what its first Linear saves) and the Tanh output (what the second
Linear saves); the product loss saves only the target (the caller's)."""


def _product_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out * target).mean()


def _parts(count: int) -> list[nn.Module]:
    def block() -> list[nn.Module]:
        return [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
    return [nn.Sequential(*([nn.Tanh()] if i == 0 else []), *block()) for i in range(count)]


# ----------------------------------------------------------------- one process
def test_storages_count_each_storage_once_and_a_view_whole() -> None:
    base, other = torch.zeros(16), torch.zeros(2)
    found = storages([base, base[:4], None, other])
    assert sorted(found.values()) == [8, 64]
    assert found[base.untyped_storage().data_ptr()] == 64


def test_optimizer_bytes_are_its_state_tensors() -> None:
    layer = nn.Linear(4, 4)
    opt = torch.optim.Adam(layer.parameters())
    assert optimizer_bytes(opt) == 0
    layer(torch.randn(2, 4)).sum().backward()
    opt.step()
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert optimizer_bytes(opt) == sum(t.untyped_storage().nbytes() for t in states)
    assert optimizer_bytes(opt) >= 2 * (16 + 4) * 4  # exp_avg and exp_avg_sq of weight and bias


def test_the_total_peak_is_the_peak_of_the_sum_and_the_optimizer_is_added() -> None:
    def point(label: str, params: int, acts: int, msgs: int) -> MemoryPoint:
        return MemoryPoint(label, 0.0, params, 0, acts, msgs, params + acts + msgs, params)
    report = MemoryReport(0, 10, 0, 0, 5, 7, 17, None, (point("a", 10, 5, 0), point("b", 10, 0, 7)))
    assert report.total_peak == 17 < report.params_peak + report.activations_peak + report.messages_peak
    assert report.with_optimizer(during=3, after=20).total_peak == max(17 + 3, 17 + 20)
    assert report.with_optimizer(during=3, after=20).optimizer == 20
    assert report.curve_of("activations") == [(0.0, 5), (0.0, 0)]
    with pytest.raises(ValueError, match="kind must be one of"):
        report.curve_of("weights")
    assert "rank 0: peak 17 B" in report.summary()


# ----------------------------------------------------------------- 4 ranks
def _measure(schedule: str, checkpointed: bool = False) -> dict[str, Any]:
    from duplexpipe import Pipeline, PipelineConfig
    from duplexpipe.planner.memory import StageBytes, rank_memory
    from duplexpipe.schedules import registry
    from duplexpipe.schedules.simulate import CostModel, simulate
    from duplexpipe.train.pipeline_config import ObserveConfig

    torch.manual_seed(0)
    groups = registry.build(schedule, WORLD, M).num_groups
    x, y = torch.randn(ROWS * M, WIDTH), torch.randn(ROWS * M, WIDTH)
    pipe = Pipeline(_parts(groups), _product_loss, lambda ps: torch.optim.Adam(ps, lr=1e-3),
                    PipelineConfig(schedule=schedule, num_microbatches=M, activation_checkpointing=checkpointed,
                                   observe=ObserveConfig(measure_memory=True)))
    reports = []
    for _ in range(2):
        pipe.step(x, y)
        assert pipe.last is not None and pipe.last.memory is not None
        reports.append(pipe.last.memory)
    sched = pipe.schedule
    stages = len(sched.stages)
    sizes = StageBytes((SAVED,) * stages, (0,) * stages, (UNIT,) * stages, (UNIT,) * stages)
    predicted = rank_memory(sched, simulate(sched, CostModel()), sizes)[dist.get_rank()]
    report = reports[-1]
    held = [p for m in pipe.stage_modules.values() for p in m.parameters()]
    params = sum(p.numel() * p.element_size() for p in held)
    return {"activations": [r.activations_peak for r in reports], "predicted": predicted.activations,
            "params": report.params_peak, "grads": report.grads_peak, "optimizer": report.optimizer,
            "messages": report.messages_peak, "total": report.total_peak,
            "param_bytes": params, "param_count": len(held),
            "points": len(report.curve), "actions": len(pipe.runtime.plan.actions),
            "recomputes": [p.activations for p in report.curve if p.label == "recompute"],
            "sum_of_peaks": report.params_peak + report.grads_peak + report.activations_peak
            + report.messages_peak + report.optimizer, "first": reports[0].optimizer}


def _worker(rank: int, world: int) -> dict[str, Any]:
    return {**{name: _measure(name) for name in SCHEDULES}, "zb-h1 checkpointed": _measure("zb-h1", True)}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_measured_activation_peak_is_the_simulators_within_10_percent(results: list[dict[str, Any]],
                                                                          schedule: str) -> None:
    for rank, result in enumerate(results):
        case = result[schedule]
        measured, predicted = case["activations"][-1], case["predicted"]
        assert predicted > 0
        assert abs(measured - predicted) <= 0.1 * predicted, f"rank {rank}: measured {measured}, predicted {predicted}"
        assert case["activations"][0] == measured, "every step measures the same"


def test_on_1f1b_the_first_rank_holds_about_4x_the_last(results: list[dict[str, Any]]) -> None:
    first, last = results[0]["1f1b"]["activations"][-1], results[-1]["1f1b"]["activations"][-1]
    assert first == 4 * SAVED and last == SAVED
    assert 3.6 <= first / last <= 4.4


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_other_kinds_are_what_the_rank_holds(results: list[dict[str, Any]], schedule: str) -> None:
    for result in results:
        case = result[schedule]
        assert case["params"] == case["param_bytes"] and case["grads"] == case["param_bytes"]
        adam = 2 * case["param_bytes"] + 4 * case["param_count"]  # exp_avg, exp_avg_sq and a float32 step each
        assert case["first"] == case["optimizer"] == adam
        assert case["messages"] > 0
        assert case["activations"][-1] + case["params"] <= case["total"] <= case["sum_of_peaks"]
        assert case["points"] > case["actions"], "a point after every action, and one per forward held"


def test_sends_are_released_before_the_steps_end_on_gloo(results: list[dict[str, Any]]) -> None:
    """Each rank of 1F1B sends M messages one way; held until the step's end (gloo's completion) they alone would
    reach M units on the first and the last rank. Released where the schedule proves them received, fewer are held
    at once."""
    for rank in (0, WORLD - 1):
        assert 0 < results[rank]["1f1b"]["messages"] < M * UNIT, rank


def test_checkpointed_recomputes_are_sampled_and_counted(results: list[dict[str, Any]]) -> None:
    """Each stage's recompute (one per microbatch, inside its I) is a point of the curve, its tensors counted: more
    than the stage's forward keeps, which under checkpointing is its input alone."""
    for rank, result in enumerate(results):
        case = result["zb-h1 checkpointed"]
        assert len(case["recomputes"]) == M, rank
        assert min(case["recomputes"]) > UNIT and case["activations"][-1] == max(case["recomputes"]), rank


def table(results: list[dict[str, Any]]) -> str:
    """Measured vs predicted activation peak per rank and schedule (bytes), one row per (schedule, rank)."""
    rows = ["schedule   rank  measured  predicted  ratio  total_peak  messages_peak"]
    for name in SCHEDULES:
        for rank, result in enumerate(results):
            case = result[name]
            measured, predicted = case["activations"][-1], case["predicted"]
            rows.append(f"{name:<10} {rank:>4} {measured:>9} {predicted:>10.0f} {measured / predicted:>6.3f} "
                        f"{case['total']:>11} {case['messages']:>14}")
    return "\n".join(rows)


if __name__ == "__main__":
    from models import run_workers

    print(table(run_workers(_worker, WORLD, timeout_s=SPAWN_TIMEOUT_S)))
