"""overhead: per-rank action/message counts and the least-squares solver for the runtime's per-action,
per-message and per-step work (on synthetic timings)."""

from __future__ import annotations

import pytest

from duplexpipe.planner.runtime_work import OverheadSample, rank_counts, rank_work, solve_overhead
from duplexpipe.schedules import registry


def synthetic(step: float, action: float, message: float, noise: tuple[float, ...] = ()) -> list[OverheadSample]:
    counts = [c for m in (4, 8) for c in rank_counts(registry.build("1f1b", 4, m))]
    out = []
    for k, (a, n) in enumerate(counts):
        jitter = noise[k % len(noise)] if noise else 0.0
        out.append(OverheadSample(a, n, step + a * action + n * message + jitter))
    return out


def test_counts_per_rank_of_the_lowered_schedule() -> None:
    # 1F1B: every rank runs M forwards and M backwards; the outer ranks send and receive M messages
    # each way once, the inner ranks twice
    assert rank_counts(registry.build("1f1b", 4, 4)) == [(8, 8), (8, 16), (8, 16), (8, 8)]
    assert rank_counts(registry.build("zb-h1", 4, 4)) == [(12, 8), (12, 16), (12, 16), (12, 8)]


def test_the_solver_recovers_known_costs() -> None:
    got = solve_overhead(synthetic(2e-3, 1e-4, 3e-5), "synthetic")
    assert (got.step_s, got.action_s, got.message_s) == pytest.approx((2e-3, 1e-4, 3e-5))
    assert got.method == "synthetic"


def test_the_solver_is_least_squares_under_noise() -> None:
    noise = (1e-5, -1e-5, 2e-5, -2e-5)
    got = solve_overhead(synthetic(2e-3, 1e-4, 3e-5, noise))
    assert got.action_s == pytest.approx(1e-4, rel=0.05) and got.message_s == pytest.approx(3e-5, rel=0.1)


def in_pipeline(alpha: float, step: float, action: float, message: float,
                noise: tuple[float, ...] = ()) -> list[OverheadSample]:
    """Samples of the real-part calibration: GPipe at M = 4 and 8 and ZB-H1 at M = 4 on 4 ranks whose
    parts cost differently (embedding and head on the outer ranks), each rank's profiled compute known."""
    from duplexpipe.planner.profile import PartProfile

    parts = [PartProfile(f, 2 * f, f / 2, 0, 0, 0, 0, backward_fused_s=2.2 * f) for f in (3e-3, 1e-3, 1e-3, 5e-3)]
    out = []
    for name, m in (("gpipe", 4), ("gpipe", 8), ("zb-h1", 4)):
        schedule = registry.build(name, 4, m)
        scaled = [p.scaled(4 / m) for p in parts]  # the same batch in M microbatches
        for k, ((a, n), c) in enumerate(zip(rank_counts(schedule), rank_work(schedule, scaled), strict=True)):
            jitter = noise[(k + m) % len(noise)] if noise else 0.0
            out.append(OverheadSample(a, n, alpha * c + step + a * action + n * message + jitter, c))
    return out


def test_the_solver_recovers_the_compute_scale_from_real_part_samples() -> None:
    got = solve_overhead(in_pipeline(1.4, 2e-3, 1e-4, 3e-5), "real parts", fit_scale=True)
    assert (got.compute_scale, got.step_s, got.action_s, got.message_s) == pytest.approx((1.4, 2e-3, 1e-4, 3e-5))
    noisy = solve_overhead(in_pipeline(1.4, 2e-3, 1e-4, 3e-5, (2e-5, -2e-5, 1e-5, -1e-5, 0.0)), fit_scale=True)
    assert noisy.compute_scale == pytest.approx(1.4, rel=0.05) and noisy.action_s == pytest.approx(1e-4, rel=0.3)
    # without fit_scale the compute is subtracted at alpha = 1: what alpha - 1 cost lands in the other terms
    fixed = solve_overhead(in_pipeline(1.0, 2e-3, 1e-4, 3e-5))
    assert fixed.compute_scale == 1.0 and fixed.action_s == pytest.approx(1e-4)


def test_the_compute_scale_needs_compute_that_varies_apart_from_the_counts() -> None:
    flat = [OverheadSample(s.actions, s.messages, s.seconds, 1e-3) for s in in_pipeline(1.4, 2e-3, 1e-4, 3e-5)]
    with pytest.raises(ValueError, match="compute scale from 12 samples"):
        solve_overhead(flat, fit_scale=True)  # the same compute on every rank and run: a copy of the step column
    with pytest.raises(ValueError, match="does not grow with their compute"):
        solve_overhead(in_pipeline(-0.5, 2e-2, 1e-4, 3e-5), fit_scale=True)  # held at 0: no scale to charge
    with pytest.raises(ValueError, match="compute must be >= 0"):
        solve_overhead([OverheadSample(1, 2, 1.0, -1.0)] * 4, fit_scale=True)


def test_a_negative_term_is_held_at_zero_and_the_rest_refit() -> None:
    got = solve_overhead(synthetic(5e-3, 1e-4, -2e-5))  # no real runtime does this: the fit clamps it
    # with messages held at 0 the refit is on (step, actions) alone: 1F1B's ranks have 1.5 messages per action
    # on average at both M, so the action term takes in their -2e-5 each (1e-4 - 1.5 x 2e-5) and the step stays
    assert got.message_s == 0.0
    assert (got.action_s, got.step_s) == pytest.approx((1e-4 - 1.5 * 2e-5, 5e-3), rel=1e-9)


def test_samples_that_cannot_separate_the_terms() -> None:
    one_m = [OverheadSample(a, n, 1e-3) for a, n in rank_counts(registry.build("1f1b", 4, 4))]
    with pytest.raises(ValueError, match="cannot separate"):
        solve_overhead(one_m)  # every rank runs 2M actions: per-step and per-action work are one column
    with pytest.raises(ValueError, match="cannot separate"):
        solve_overhead([])
    with pytest.raises(ValueError, match="bad overhead sample"):
        solve_overhead([OverheadSample(-1, 2, 1.0)] * 3)


def test_rank_work_prices_each_rank_s_actions_and_overheads() -> None:
    from duplexpipe.planner.profile import PartProfile, RuntimeOverhead

    part = PartProfile(1.0, 2.0, 0.5, 0, 0, 0, 0, backward_fused_s=2.25)
    over = RuntimeOverhead(0.1, 0.01, 3.0)
    # 1F1B, P=2, M=2: each rank 2 F + 2 fused B, 4 messages
    assert rank_work(registry.build("1f1b", 2, 2), [part, part], over) == pytest.approx([2 + 4.5 + 0.4 + 0.04 + 3] * 2)
    scaled = RuntimeOverhead(0.1, 0.01, 3.0, compute_scale=2.0)  # the compute doubled, the rest as before
    assert rank_work(registry.build("1f1b", 2, 2), [part, part], scaled) == pytest.approx([13 + 0.44 + 3] * 2)
    # ZB-H1: I and W instead of B; without overhead only the compute
    assert rank_work(registry.build("zb-h1", 2, 2), [part, part]) == pytest.approx([2 * (1 + 2 + 0.5)] * 2)
    with pytest.raises(ValueError, match="has 2 model parts, got 1"):
        rank_work(registry.build("1f1b", 2, 2), [part])
