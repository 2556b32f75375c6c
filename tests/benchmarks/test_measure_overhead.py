"""benchmarks.measure_overhead: the calibrations run the real runtime on 2 gloo ranks and solve."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from models import run_workers

from benchmarks import harness
from benchmarks.measure_overhead import CalibrationRun, TinyPart, measure_in_pipeline, measure_overhead
from duplexpipe import PipelineConfig, profile_parts
from duplexpipe.planner.profile import Profile
from duplexpipe.planner.runtime_work import rank_counts, rank_work
from duplexpipe.schedules import registry
from duplexpipe.train.pipeline_config import ObserveConfig, SafetyConfig


def _calibrate(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = PipelineConfig(observe=ObserveConfig(record_timeline=False),
                            safety=SafetyConfig(check_inputs_every_step=False))
    cal = measure_overhead(torch.randn(2, 8), steps=2, warmup=1, config=config)
    o = cal.overhead
    return {"overhead": (o.action_s, o.message_s, o.step_s), "method": o.method, "wall": cal.wall_s,
            "samples": [(s.actions, s.messages, s.seconds) for s in cal.samples], "tiny": cal.tiny_s}


@pytest.mark.timeout(120)
def test_calibration_on_two_ranks_measures_every_rank_on_every_run() -> None:
    results = run_workers(_calibrate, 2, timeout_s=100)
    first = results[0]
    assert all(r["overhead"] == first["overhead"] for r in results)  # every rank solved the same samples
    assert min(first["overhead"]) >= 0 and first["tiny"] >= 0
    runs = [("1f1b", 2), ("1f1b", 4), ("zb-h1", 4)]
    counts = [(a, n) for a, n, _ in first["samples"]]
    assert counts == [rank_counts(registry.build(name, 2, m))[r] for r in range(2) for name, m in runs]
    assert sorted(first["wall"]) == sorted(runs) and all(v > 0 for v in first["wall"].values())
    assert "1f1b M=2, 1f1b M=4, zb-h1 M=4 on 2 ranks" in first["method"]


def _mlp(layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh())
                                 for _ in range(layers)])


TERMS = (1.3, 50e-6, 120e-6, 2e-3)
"""The scripted CPU costs: compute scale, seconds per compute action, per SEND/RECV, per step."""


def _real_parts(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    parts = [_mlp(1), _mlp(4)]  # the last rank's part costs 4x the first's: alpha is told apart from the rest
    x, y = torch.randn(32, 128), torch.randn(32, 128)
    measured = [profile_parts(parts, x[:8], target=y[:8], loss_fn=torch.nn.functional.mse_loss, repeats=2,
                              fit_rows=4).to_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(measured, src=0)  # rank 0's profile on every rank
    profile = Profile.from_dict(measured[0])
    runs = []
    for name, m in (("gpipe", 4), ("gpipe", 8), ("zb-h1", 4)):
        schedule = registry.build(name, world, m)
        runs.append(CalibrationRun(schedule, [copy.deepcopy(p) for p in parts],
                                   profile.at_microbatch(32 / m).grouped(2, [1, 1])))
    config = PipelineConfig(observe=ObserveConfig(record_timeline=False),
                            safety=SafetyConfig(check_inputs_every_step=False))
    computes = [rank_work(r.schedule, r.groups) for r in runs]
    scale, action, message, step = TERMS
    costs = [scale * computes[k][rank] + action * rank_counts(r.schedule)[rank][0]
             + message * rank_counts(r.schedule)[rank][1] + step for k, r in enumerate(runs)]
    cal = measure_in_pipeline(runs, (x, y), torch.nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=1e-3),
                              steps=3, warmup=1, config=config, cpu_timer=harness.ScriptedStepClock(costs))
    o = cal.overhead
    return {"terms": (o.compute_scale, o.action_s, o.message_s, o.step_s), "method": o.method, "wall": cal.wall_s,
            "samples": [(s.actions, s.messages, s.seconds, s.compute) for s in cal.samples], "computes": computes}


@pytest.mark.timeout(120)
def test_in_pipeline_calibration_with_real_parts_solves_for_the_cpu_costs() -> None:
    """The real parts train in the pipeline; the CPU timer is scripted (no test depends on the machine's
    speed), so the solve must give back exactly the costs it was scripted with."""
    results = run_workers(_real_parts, 2, timeout_s=100)
    first = results[0]
    assert all(r["terms"] == first["terms"] for r in results)  # every rank solved the same samples
    assert first["terms"] == pytest.approx(TERMS, rel=1e-6)  # the real runs' samples solved for the scripted costs
    runs = [("gpipe", 4), ("gpipe", 8), ("zb-h1", 4)]
    want = [(*rank_counts(registry.build(name, 2, m))[r], first["computes"][k][r])
            for r in range(2) for k, (name, m) in enumerate(runs)]
    assert [(a, n, c) for a, n, _, c in first["samples"]] == want
    assert all(c > 0 and s > 0 for _, _, s, c in first["samples"])
    assert want[3][2] > want[0][2]  # rank 1 runs the heavier part: its profiled compute is larger
    assert sorted(first["wall"]) == sorted(runs) and all(v > 0 for v in first["wall"].values())
    assert "gpipe M=4, gpipe M=8, zb-h1 M=4 on 2 ranks with the real parts" in first["method"]


def test_tiny_part_and_bad_arguments() -> None:
    part = TinyPart()
    x = torch.randn(3, 4)
    assert torch.equal(part(x), x) and sum(p.numel() for p in part.parameters()) == 1
    with pytest.raises(ValueError, match="initialized process group"):
        measure_overhead(x)
    with pytest.raises(ValueError, match="initialized process group"):
        measure_in_pipeline([], (x, x), torch.nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.0))
