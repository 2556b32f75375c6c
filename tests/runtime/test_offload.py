"""Activation offload: the plan read from a rank's list, the parcels' round trip, and 4 ranks exact (float64) under
1F1B, ZB-H1, ZBV and DualPipeV with the measured activation peak lowered and the bytes moved reported.

`python tests/runtime/test_offload.py` prints the bytes moved and the measured peaks per schedule and rank (run from
the repository root with the tests folder on PYTHONPATH)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _executor_cases import _grad_errors, _inputs, stage_setup
from models import loss_fn, make_batch, make_parts, reference
from torch import nn

from duplexpipe.runtime.offload import Offload, check_offload
from duplexpipe.runtime.stage_compute import Activations
from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.offload import OffloadPlan, offload_plan
from duplexpipe.schedules.registry import build

WORLD = 4
SPAWN_TIMEOUT_S = 240
SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev")
POLICIES: tuple[bool | float, ...] = (False, True, 0.5)
M = 8
TIGHT = 1e-12
"""float64 pipeline vs float64 reference: only summation order differs."""


# ----------------------------------------------------------------- one process
def _walk(schedule_name: str, rank: int, policy: bool | float) -> tuple[OffloadPlan, list[Any]]:
    actions = lower(build(schedule_name, WORLD, M)).actions[rank]
    return offload_plan(actions, policy), list(actions)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("policy", [True, 0.5])
def test_every_offload_comes_back_after_a_compute_action_and_before_its_backward(name: str,
                                                                                 policy: bool | float) -> None:
    for rank in range(WORLD):
        plan, actions = _walk(name, rank, policy)
        out = {k: p for p, keys in plan.offload_after.items() for k in keys}
        back = {k: p for p, keys in plan.prefetch_after.items() for k in keys}
        assert sum(map(len, plan.offload_after.values())) == len(out), "each forward is offloaded at most once"
        assert out.keys() == back.keys()
        for key, pos in out.items():
            due = next(p for p, a in enumerate(actions) for part in a.compute_parts()
                       if (part.stage, part.microbatch) == key and part.op in (Op.B, Op.I))
            made = next(p for p, a in enumerate(actions) for part in a.compute_parts()
                        if (part.stage, part.microbatch) == key and part.op is Op.F)
            assert made <= pos < back[key] < due
            assert any(a.op.is_compute for a in actions[pos + 1:back[key] + 1]), "a compute runs while it is away"
            following = [p for p in range(back[key] + 1, due) if actions[p].op.is_compute]
            assert len(following) == 1, "the copy back is issued one compute action before the B or I"


def test_1f1b_offloads_all_but_the_nearest_and_nothing_on_the_last_rank() -> None:
    plan, actions = _walk("1f1b", 0, True)
    assert plan.moves == M - 1, "every microbatch but the last one (whose B follows the warm-up's end)"
    assert _walk("1f1b", WORLD - 1, True)[0].moves == 0, "the last rank runs each B right after its F"
    on_device = 0
    live: set[tuple[int, int]] = set()
    away: set[tuple[int, int]] = set()
    for pos, action in enumerate(actions):  # after each action's moves, at most one live forward stays on the device
        for part in action.compute_parts():
            key = (part.stage, part.microbatch)
            if part.op is Op.F:
                live.add(key)
            elif part.op is Op.B:
                live.discard(key)
        away |= set(plan.offload_after.get(pos, ()))
        away -= set(plan.prefetch_after.get(pos, ()))
        on_device = max(on_device, len(live - away))
    assert on_device == 2, "the nearest, and the next one prefetched one compute action before its B"


def test_a_fraction_offloads_fewer() -> None:
    for name in SCHEDULES:
        for rank in range(WORLD):
            assert _walk(name, rank, 0.5)[0].moves <= _walk(name, rank, True)[0].moves


def test_check_offload_takes_bools_and_fractions() -> None:
    for good in (True, False, 0.25, 1, 1.0):
        check_offload(good, "x")
    for bad in (0, 0.0, 1.5, -0.1, "yes", None):
        with pytest.raises(ValueError, match="x must be True, False or a fraction"):
            check_offload(bad, "x")


def test_the_config_fields_are_checked() -> None:
    from duplexpipe import PipelineConfig

    with pytest.raises(ValueError, match="PipelineConfig.activation_offload"):
        PipelineConfig(activation_offload=2.0)
    assert PipelineConfig(activation_offload=0.5).activation_offload == 0.5


def test_parcels_round_trip_exactly_and_leave_parameters_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    model(x).pow(2).sum().backward()
    want = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    offload = Offload(OffloadPlan({}, {}), Activations(), torch.device("cpu"))
    with offload.saving(0, 0, model):
        y = model(x).pow(2).sum()
    parcels = offload.parcels[(0, 0)]
    # the tanh output (saved by Tanh and by the second Linear: one storage) and the second Linear's output (pow);
    # not the input leaf, not the weights (nor their transposed views)
    assert sorted(p.nbytes for p in parcels.values()) == [3 * 4 * 8, 3 * 8 * 8]
    offload.offload((0, 0))
    assert offload.offloaded_bytes == 3 * 4 * 8 + 3 * 8 * 8
    assert all(p.device_bytes is None and p.host is not None for p in parcels.values())
    offload.prefetch((0, 0))
    assert offload.prefetched_bytes == offload.offloaded_bytes
    offload.backward_starts(0, 0)
    assert not offload.parcels
    y.backward()
    got = [p.grad for p in model.parameters()] + [x.grad]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_parcel_never_prefetched_comes_back_at_its_unpack() -> None:
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    offload = Offload(OffloadPlan({}, {}), Activations(), torch.device("cpu"))
    with offload.saving(0, 0, nn.Identity()):
        y = (x.exp() * 2).sum()
    offload.offload((0, 0))
    y.backward()
    assert torch.equal(x.grad, 2 * x.detach().exp())


# ----------------------------------------------------------------- 4 ranks
def _case(name: str, policy: bool | float) -> dict[str, Any]:
    from duplexpipe.runtime import PipelineRuntime, RuntimeConfig

    rank = dist.get_rank()
    schedule, parts, modules = stage_setup(name, WORLD, M, rank, seed=11, dtype=torch.float64)
    runtime = PipelineRuntime(schedule, modules, loss_fn, config=RuntimeConfig(measure_memory=True),
                              activation_offload=policy)
    batches = [make_batch(2 * M, 1), make_batch(2 * M, 2)]  # the second step runs the hoisted plan
    results = [runtime.step(*_inputs(schedule, rank, b)) for b in batches]
    ref_losses, ref_grads, _ = reference(parts, batches)
    memory = [r.memory for r in results]
    assert all(m is not None for m in memory)
    return {
        "loss_err": max(abs(r.loss - w) / abs(w) for r, w in zip(results, ref_losses, strict=True)),
        "grad_err": _grad_errors(schedule, modules, ref_grads),
        "grads": [p.grad.flatten().tolist() for m in modules.values() for p in m.parameters()],
        "losses": [r.loss for r in results],
        "offloaded": [m.offloaded_bytes for m in memory if m is not None],
        "peak": [m.activations_peak for m in memory if m is not None],
        "saved_peak": [r.peak_saved_bytes for r in results],
        "moves": offload_plan(schedule.actions[rank], policy).moves if policy is not False else 0,
    }


def _pipeline_case() -> dict[str, Any]:
    """The PipelineConfig field reaches the runtime; pipe.last.memory reports the bytes moved."""
    from duplexpipe import Pipeline, PipelineConfig
    from duplexpipe.train.pipeline_config import ObserveConfig

    parts = make_parts(WORLD, seed=3, dtype=torch.float64)
    x, y = make_batch(2 * M, 5)
    pipe = Pipeline(parts, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1),
                    PipelineConfig("1f1b", M, activation_offload=True, observe=ObserveConfig(measure_memory=True)))
    pipe.step(x, y)
    assert pipe.last is not None and pipe.last.memory is not None
    return {"offloaded": pipe.last.memory.offloaded_bytes, "summary": pipe.last.memory.summary()}


def _worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {f"{name} {policy}": _case(name, policy) for name in SCHEDULES for policy in POLICIES}
    out["pipeline"] = _pipeline_case()
    return out


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("policy", POLICIES)
def test_offload_is_exact_against_one_process(results: list[dict[str, Any]], name: str,
                                              policy: bool | float) -> None:
    for result in results:
        case, plain = result[f"{name} {policy}"], result[f"{name} False"]
        assert case["grad_err"] < TIGHT and case["loss_err"] < TIGHT
        assert case["losses"] == plain["losses"], "bit-equal to the run without offload"
        assert case["grads"] == plain["grads"]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("policy", [True, 0.5])
def test_the_bytes_moved_are_reported_and_the_measured_peak_drops(results: list[dict[str, Any]], name: str,
                                                                  policy: bool | float) -> None:
    for rank, result in enumerate(results):
        case, plain = result[f"{name} {policy}"], result[f"{name} False"]
        assert plain["offloaded"] == [0, 0]
        assert case["offloaded"][0] == case["offloaded"][1], "every step moves the same"
        assert (case["offloaded"][0] > 0) == (case["moves"] > 0), f"rank {rank}"
        assert case["peak"][-1] <= plain["peak"][-1], f"rank {rank}"
        assert case["saved_peak"] == plain["saved_peak"], "what forwards keep for backward is the same"
    first, plain = results[0][f"{name} {policy}"], results[0][f"{name} False"]
    # rank 0 holds the most forwards: at most the nearest and the one just made stay on the device
    assert first["moves"] > 0 and first["peak"][-1] <= plain["peak"][-1] / 2


def test_true_holds_at_most_what_a_fraction_holds(results: list[dict[str, Any]]) -> None:
    for result in results:
        for name in SCHEDULES:
            assert result[f"{name} True"]["peak"][-1] <= result[f"{name} 0.5"]["peak"][-1]


def test_the_pipeline_config_field_offloads(results: list[dict[str, Any]]) -> None:
    assert results[0]["pipeline"]["offloaded"] > 0
    assert "offloaded" in results[0]["pipeline"]["summary"]
    assert results[-1]["pipeline"]["offloaded"] == 0


def table(results: list[dict[str, Any]]) -> str:
    """Bytes moved per step and the measured activation peak (bytes) without offload, with True and with 0.5, per
    (schedule, rank)."""
    rows = ["schedule   rank  peak_plain  peak_true  moved_true  peak_half  moved_half"]
    for name in SCHEDULES:
        for rank, result in enumerate(results):
            plain, full, half = (result[f"{name} {p}"] for p in POLICIES)
            rows.append(f"{name:<10} {rank:>4} {plain['peak'][-1]:>11} {full['peak'][-1]:>10} "
                        f"{full['offloaded'][-1]:>11} {half['peak'][-1]:>10} {half['offloaded'][-1]:>11}")
    return "\n".join(rows)


if __name__ == "__main__":
    from models import run_workers

    print(table(run_workers(_worker, WORLD, timeout_s=SPAWN_TIMEOUT_S)))
