"""Tests of fitting a CostModel to a timeline: a simulation's own costs are recovered."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from duplexpipe.planner.calibrate import (
    FIT_ERROR,
    MAX_SCALE,
    calibration_machine,
    calibration_rounds,
    calibration_runs,
    calibration_schedule,
    fit_cores,
    fit_cost_model,
    fit_error,
    fit_wall_scale,
    with_calibration,
)
from duplexpipe.planner.plan import PlanConfig, plan
from duplexpipe.planner.profile import PartProfile, Profile, RuntimeOverhead
from duplexpipe.planner.runtime_work import OverheadSample, rank_counts, rank_work, solve_overhead
from duplexpipe.schedules import registry
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.schedules.timeline import Timeline


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "dualpipe", "dualpipev"])
def test_fit_recovers_per_stage_costs(name: str) -> None:
    schedule = registry.build(name, 4, 8)
    truth = {s: (1.0 + 0.1 * s, 2.0 + 0.2 * s, 0.5 + 0.05 * s) for s in range(schedule.num_stages)}
    timeline = simulate(schedule, CostModel(stage_costs=truth))
    fitted = fit_cost_model(timeline)
    for stage, (f, b, w) in truth.items():
        got = fitted.stage_costs[stage]
        assert got[0] == pytest.approx(f) and got[1] == pytest.approx(b), (stage, got)
        if any(e.action.op.value == "W" and e.action.stage == stage for e in timeline.events):
            assert got[2] == pytest.approx(w), (stage, got)
    again = simulate(schedule, fitted)
    assert again.makespan == pytest.approx(timeline.makespan)
    assert again.bubble_ratio == pytest.approx(timeline.bubble_ratio)


def test_fit_rejects_an_empty_timeline() -> None:
    with pytest.raises(ValueError, match="no plain"):
        fit_cost_model(Timeline("x", 1, 1, ()))


def test_calibration_runs_vary_m_and_backward_kind() -> None:
    assert calibration_runs(4, [4, 8, 16, 32]) == [("gpipe", 4), ("gpipe", 8), ("zb-h1", 4)]
    assert calibration_runs(2, [1, 2, 4, 8, 16]) == [("gpipe", 2), ("gpipe", 4), ("zb-h1", 2)]
    assert calibration_runs(4, [2, 3]) == [("gpipe", 2), ("gpipe", 3), ("zb-h1", 2)], "below P: the smallest"
    assert calibration_runs(4, [8]) == [("gpipe", 8), ("zb-h1", 8)], "one M: no second GPipe"
    with pytest.raises(ValueError, match="microbatch counts >= 1"):
        calibration_runs(4, [])


def test_calibration_rounds_fit_the_budget_within_bounds() -> None:
    assert calibration_rounds(0.5, 3.0) == 6
    assert calibration_rounds(0.01, 3.0) == 20, "capped at most"
    assert calibration_rounds(10.0, 3.0) == 3, "never fewer than least"
    assert calibration_rounds(0.0, 3.0, least=2, most=7) == 7
    with pytest.raises(ValueError, match="1 <= least <= most"):
        calibration_rounds(1.0, 3.0, least=5, most=4)



def test_fit_wall_scale_is_the_measured_over_modelled_wall_of_the_calibration_runs() -> None:
    part = PartProfile(1e-3, 1e-3, 1e-3, 0, 0, 1024, 1024)
    profile = Profile((part,) * 4, 4, overhead=RuntimeOverhead(1e-4, 5e-5, 1e-3, "", 1.2, wall_scale=3.0))
    config = PlanConfig(ranks=4, batch=32, memory=2**40, cores=2)
    unscaled = replace(profile, overhead=RuntimeOverhead(1e-4, 5e-5, 1e-3, "", 1.2))
    model = {(n, m): plan(unscaled, replace(config, schedules=(n,), microbatches=(m,))).best.step_s
             for n, m in (("gpipe", 4), ("gpipe", 8), ("zb-h1", 4))}
    walls = [(n, m, 1.7 * step) for (n, m), step in model.items()]
    assert fit_wall_scale(profile, config, walls) == pytest.approx(1.7), "the profile's own scale is ignored"
    mixed = [(n, m, step * k) for ((n, m), step), k in zip(model.items(), (1.0, 2.0, 4.0), strict=True)]
    assert fit_wall_scale(profile, config, mixed) == pytest.approx(2.0), "geometric mean"
    assert fit_wall_scale(profile, config, []) == 1.0
    scaled = replace(profile, overhead=RuntimeOverhead(1e-4, 5e-5, 1e-3, "", 1.2, wall_scale=1.7))
    again = plan(scaled, replace(config, schedules=("gpipe",), microbatches=(4,))).best
    assert again.step_s == pytest.approx(1.7 * model[("gpipe", 4)]), "the planner multiplies its times by it"


def test_with_calibration_applies_the_measured_link_and_walls_once_in_range() -> None:
    """What schedule="auto" and `duplexpipe plan` take from a calibrated profile."""
    part = PartProfile(1e-3, 1e-3, 1e-3, 0, 0, 1024, 1024)
    overhead = RuntimeOverhead(1e-4, 5e-5, 1e-3, "", 1.0)
    config = PlanConfig(ranks=4, batch=32, memory=2**40)
    bare = Profile((part,) * 4, 4, overhead=overhead)
    model = plan(bare, replace(config, schedules=("gpipe",), microbatches=(4,))).best.step_s
    measured = replace(bare, meta={"p2p_link": [2e-5, 1e9], "calibration_walls": [["gpipe", 4, 2 * model]]})
    profile, planned, note = with_calibration(measured, config)
    assert (planned.p2p_link.latency, planned.p2p_link.bandwidth) == (2e-5, 1e9) and "link 20 us per message" in note
    assert profile.overhead is not None and profile.overhead.wall_scale > 1.0 and "walls" in note
    kept, same, _ = with_calibration(measured, config, links=())
    assert same.p2p_link == config.p2p_link
    far = replace(bare, meta={"calibration_walls": [["gpipe", 4, 2 * MAX_SCALE * model]]})
    unchanged, _, note = with_calibration(far, config)
    assert unchanged == far and "not applied" in note
    assert with_calibration(Profile((part,) * 4, 4), config) == (Profile((part,) * 4, 4), config, "")


FUSED = PartProfile(2e-3, 1e-3, 1e-3, 0, 0, 1024, 1024, backward_fused_s=1.6e-3, forward_fixed_s=5e-4,
                    backward_input_fixed_s=3e-4, backward_weight_fixed_s=3e-4, backward_fused_fixed_s=5e-4)
"""A part whose fused B is cheaper than I + W, each pass affine in the rows (as profiled)."""


def test_calibration_runs_add_interleaved_when_the_model_has_two_parts_per_rank() -> None:
    assert calibration_runs(4, [4, 8, 16, 32], parts=8) == [("gpipe", 4), ("gpipe", 8), ("zb-h1", 4),
                                                            ("interleaved-1f1b", 4)]
    assert calibration_runs(4, [4, 8, 16, 32], parts=7)[-1] == ("zb-h1", 4), "fewer than 2P parts: no chunks"
    assert calibration_runs(4, [2, 3], parts=8)[-1] == ("zb-h1", 2), "M not a multiple of P: interleaved refuses it"
    schedule = calibration_schedule("interleaved-1f1b", 4, 4)
    assert schedule.num_groups == 8 and calibration_schedule("gpipe", 4, 4).num_groups == 4


def _samples(runs: list[tuple[str, int]], noise: float, seed: int) -> list[OverheadSample]:
    """Every rank's CPU seconds of each run under known terms (alpha 1.2, 500 us per action, 200 us per message,
    2 ms per step), each off by up to +-noise (seeded)."""
    rng, profile, out = random.Random(seed), Profile((FUSED,) * 8, 8), []
    for name, m in runs:
        schedule = calibration_schedule(name, 4, m)
        groups = profile.at_microbatch(32 / m).grouped(schedule.num_groups, profile.group_sizes(schedule.num_groups))
        for (actions, messages), work in zip(rank_counts(schedule), rank_work(schedule, groups), strict=True):
            seconds = 1.2 * work + 5e-4 * actions + 2e-4 * messages + 2e-3
            out.append(OverheadSample(actions, messages, seconds * (1 + rng.uniform(-noise, noise)), work))
    return out


def _action_errors(runs: list[tuple[str, int]]) -> list[float]:
    errors = []
    for seed in range(20):
        try:
            fitted = solve_overhead(_samples(runs, 0.05, seed), fit_scale=True)
            errors.append(abs(fitted.action_s - 5e-4) / 5e-4)
        except ValueError:
            errors.append(math.inf)
    return errors


def test_the_interleaved_run_keeps_the_per_action_work_apart_from_the_compute_scale() -> None:
    """GPipe at two M and ZB-H1 grow a rank's actions with its compute, so 5% noise can hand the per-action work to
    the compute scale (or fail the fit); interleaved 1F1B does GPipe's compute with twice the actions."""
    runs = calibration_runs(4, [4, 8, 16, 32], parts=8)
    exact = solve_overhead(_samples(runs, 0.0, 0), fit_scale=True)
    terms = (exact.compute_scale, exact.action_s, exact.message_s, exact.step_s)
    assert terms == pytest.approx((1.2, 5e-4, 2e-4, 2e-3))
    with_interleaved, without = _action_errors(runs), _action_errors(runs[:3])
    assert max(with_interleaved) < 0.75, with_interleaved
    assert max(without) > 1.0, without  # why the run was added


def test_fit_cores_recovers_the_cores_the_calibration_runs_got() -> None:
    profile = Profile((FUSED,) * 8, 8, overhead=RuntimeOverhead(1.5e-3, 2e-4, 2e-3, "", 1.0))
    config = PlanConfig(ranks=4, batch=32, memory=2**40, cores=2)
    runs = calibration_runs(4, [4, 8, 16, 32], parts=8)

    def walls(cores: float) -> list[tuple[str, int, float]]:
        at = replace(config, cores=cores)
        return [(n, m, plan(profile, replace(at, schedules=(n,), microbatches=(m,))).best.step_s) for n, m in runs]

    assert fit_cores(profile, config, walls(0.7), 2.0) == pytest.approx(0.7, rel=1e-3)
    assert fit_cores(profile, config, walls(2.0), 2.0) == 2.0, "never more than the machine's cores"
    assert fit_cores(profile, config, [], 2.0) == 2.0


def test_with_calibration_plans_on_the_calibrations_cores_and_the_share_its_runs_got() -> None:
    """A profile calibrated on 2 cores whose runs got 0.7 of them: plan defaults to that, and on cores shared by the
    ranks the per-action and per-message work of interleaved 1F1B outweighs its smaller bubble (it leads on a device
    per rank)."""
    overhead = RuntimeOverhead(3e-4, 2e-4, 2e-3, "", 1.0)
    profile = Profile((FUSED,) * 8, 8, overhead=overhead)
    config = PlanConfig(ranks=4, batch=32, memory=2**40, schedules=("1f1b", "interleaved-1f1b"), microbatches=(4,),
                        chunks=(2,))
    runs = calibration_runs(4, [4, 8, 16, 32], parts=8)
    at = replace(config, cores=0.7)
    walls = [[n, m, plan(profile, replace(at, schedules=(n,), microbatches=(m,))).best.step_s] for n, m in runs]
    mesh = {"ranks": 4, "batch": 32, "cores": 2}
    measured = replace(profile, meta={"calibration_walls": walls, "calibration_mesh": mesh})
    fitted, planned, note = with_calibration(measured, config)
    assert planned.cores == pytest.approx(0.7, rel=1e-3) and "2 cores shared by the ranks, as calibrated" in note
    assert fitted.overhead is not None and fitted.overhead.wall_scale == pytest.approx(1.0, rel=1e-3)
    assert [r.schedule for r in plan(fitted, planned).rows] == ["1f1b", "interleaved-1f1b(chunks=2)"]
    assert plan(profile, config).rows[0].schedule == "interleaved-1f1b(chunks=2)", "a device per rank"
    other, elsewhere, note = with_calibration(measured, replace(config, cores=8))
    assert elsewhere.cores == 8 and "as calibrated" not in note, "planning another machine: no share fitted"
    assert calibration_machine(measured) == (4, 32, 2.0)
    assert calibration_machine(replace(profile, meta={"calibration_mesh": {"ranks": True, "cores": -1}})) == (
        None, None, None)


def test_the_fit_error_is_how_far_the_fitted_model_misses_its_calibration_runs() -> None:
    """Walls the model reproduces: no error; one run 10% slower than the rest, as a noisy run would be: the geometric
    scale takes part of it, the error says what is left, in the profile's meta and the note."""
    overhead = RuntimeOverhead(3e-4, 2e-4, 2e-3, "", 1.0)
    profile = Profile((FUSED,) * 8, 8, overhead=overhead)
    config = PlanConfig(ranks=4, batch=32, memory=2**40)
    runs = [(n, m, plan(profile, replace(config, schedules=(n,), microbatches=(m,))).best.step_s)
            for n, m in calibration_runs(4, [4, 8], parts=8)]
    assert fit_error(profile, config, runs) == pytest.approx(0.0, abs=1e-9)
    assert fit_error(profile, config, []) == 0.0
    noisy = [(n, m, w * (1.1 if k == 0 else 1.0)) for k, (n, m, w) in enumerate(runs)]
    fitted, _, note = with_calibration(replace(profile, meta={"calibration_walls": [list(r) for r in noisy]}), config)
    error = fitted.meta[FIT_ERROR]
    assert 0.05 < error < 0.1 and error == pytest.approx(fit_error(fitted, config, noisy))
    assert f"the model is within {error:.0%} of its calibration runs" in note
