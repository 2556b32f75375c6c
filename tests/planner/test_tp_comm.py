"""Tensor parallelism in the planner: collectives priced from bytes and the TP link, a TP rank's share of a part,
the memory per rank divided by T (replicated parameters kept whole), and profiles that cannot be planned at T."""

from __future__ import annotations

import json
import math

import pytest

from duplexpipe.errors import PlanError, ProfileError
from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.plan import PlanConfig, plan
from duplexpipe.planner.profile import PartProfile, Profile, TPFacts
from duplexpipe.planner.tp_comm import (
    DEFAULT_TP_BANDWIDTH,
    all_reduce_time,
    collective_times,
    local_part,
    local_profile,
    tp_refusal,
)

MIB = 2**20
FACTS = TPFacts(forward_collectives=2, forward_bytes=2 * 64 * 1024, backward_collectives=4,
                backward_bytes=4 * 64 * 1024, replicated_param_bytes=MIB)


def part(**changes: object) -> PartProfile:
    """A transformer-like part at microbatch 4: F = I = W = 1 ms (0.2 ms fixed), 8 MiB of parameters (1 MiB of
    them replicated under TP), 1 MiB of activations, 64 KiB messages."""
    base = PartProfile(1e-3, 1e-3, 1e-3, MIB, 8 * MIB, 64 * 1024, 64 * 1024, forward_fixed_s=2e-4,
                       backward_input_fixed_s=2e-4, backward_weight_fixed_s=2e-4, tp=FACTS)
    return base if not changes else PartProfile(**{**base.__dict__, **changes})  # type: ignore[arg-type]


def profile(parts: int = 4, degrees: tuple[int, ...] | None = (2, 4)) -> Profile:
    return Profile(tuple(part() for _ in range(parts)), 4, tp_degrees=degrees)


def test_an_all_reduce_costs_more_with_more_bytes_and_less_bandwidth() -> None:
    link = Link(1e9, 1e-5)
    assert all_reduce_time(MIB, 1, link) == 0.0  # one rank: nothing to reduce
    times = [all_reduce_time(nbytes, 2, link) for nbytes in (0, 1024, MIB, 16 * MIB)]
    assert times == sorted(times) and len(set(times)) == 4
    assert times[0] == pytest.approx(2 * 1e-5)  # 2(T-1) messages' latency
    assert all_reduce_time(MIB, 2, link) == pytest.approx(2e-5 + MIB / 1e9)  # 2(T-1)/T of the bytes
    slower = [all_reduce_time(MIB, 2, Link(bw, 1e-5)) for bw in (1e12, 1e10, 1e8)]
    assert slower == sorted(slower) and len(set(slower)) == 3
    assert all_reduce_time(MIB, 4, link, collectives=3) > all_reduce_time(MIB, 4, link, collectives=1)
    forward, backward = collective_times(FACTS, 2, link)
    assert backward > forward > 0  # 4 collectives of 2x the bytes against 2


def test_a_tp_rank_divides_the_compute_but_not_its_fixed_part_and_adds_its_collectives() -> None:
    link = Link(1e9, 1e-5)
    whole = part()
    local = local_part(whole, 2, link, sequence_parallel=False)
    forward, backward = collective_times(FACTS, 2, link)
    assert local.forward_s == pytest.approx(2e-4 + 8e-4 / 2 + forward)
    assert local.backward_input_s == pytest.approx(2e-4 + 8e-4 / 2 + backward)
    assert local.backward_weight_s == pytest.approx(2e-4 + 8e-4 / 2)  # W issues no collective
    free = local_part(whole, 4, Link(math.inf), sequence_parallel=False)
    assert free.forward_s == pytest.approx(2e-4 + 8e-4 / 4)
    assert local_part(whole, 1, link, False) is whole


def test_parameters_are_divided_by_tp_except_the_replicated_ones_and_sp_divides_activations_and_messages() -> None:
    link = Link(DEFAULT_TP_BANDWIDTH)
    for tp in (2, 4):
        plain = local_part(part(), tp, link, sequence_parallel=False)
        assert plain.param_bytes == MIB + 7 * MIB // tp
        assert (plain.activation_bytes, plain.output_bytes, plain.output_grad_bytes) == (MIB, 64 * 1024, 64 * 1024)
        sp = local_part(part(), tp, link, sequence_parallel=True)
        assert sp.param_bytes == plain.param_bytes
        assert (sp.activation_bytes, sp.output_bytes, sp.output_grad_bytes) == (MIB // tp, 64 * 1024 // tp,
                                                                                 64 * 1024 // tp)


def test_memory_per_rank_in_the_plan_is_divided_by_tp() -> None:
    rows = {}
    for tp in (1, 2, 4):
        config = PlanConfig(ranks=2, batch=16, memory=2**40, tp=tp, schedules=("1f1b",), microbatches=(8,),
                            sequence_parallel=True)
        rows[tp] = plan(profile(), config).best
    for tp in (2, 4):
        for whole, local in zip(rows[1].memory, rows[tp].memory, strict=True):
            assert local.params == 2 * (MIB + 7 * MIB / tp) == pytest.approx(whole.params * (1 + 7 / tp) / 8)
            assert local.gradients == local.params and local.optimizer == 2 * local.params  # AdamW, fp32
            assert local.activations == pytest.approx(whole.activations / tp, rel=1e-6)
        assert rows[tp].tp == tp and rows[tp].peak_bytes < rows[1].peak_bytes
    assert rows[2].mesh == "2x1x2" and rows[2].to_dict()["tp"] == 2


def test_step_time_grows_with_the_collectives_bytes_and_falls_with_the_bandwidth() -> None:
    def step(bandwidth: float, scale: int = 1) -> float:
        facts = TPFacts(2, 2 * 64 * 1024 * scale, 4, 4 * 64 * 1024 * scale, MIB)
        prof = Profile(tuple(part(tp=facts) for _ in range(4)), 4, tp_degrees=(2,))
        config = PlanConfig(ranks=2, batch=16, memory=2**40, tp=2, schedules=("1f1b",), microbatches=(8,),
                            tp_link=Link(bandwidth))
        return plan(prof, config).best.step_s
    by_bandwidth = [step(bw) for bw in (1e12, 1e10, 1e8)]
    assert by_bandwidth == sorted(by_bandwidth) and len(set(by_bandwidth)) == 3
    by_bytes = [step(1e9, scale) for scale in (1, 4, 16)]
    assert by_bytes == sorted(by_bytes) and len(set(by_bytes)) == 3


def test_profiles_that_cannot_be_planned_at_a_tp_degree_say_why() -> None:
    assert tp_refusal(profile(), 1) is None and tp_refusal(profile(degrees=None), 1) is None
    assert "no tensor-parallel facts" in (tp_refusal(profile(degrees=None), 2) or "")
    assert "cannot shard the model at tp=3 (degrees it can: 2, 4)" in (tp_refusal(profile(), 3) or "")
    with pytest.raises(PlanError, match="tp=8"):
        local_profile(profile(), 8, Link(), False)
    with pytest.raises(PlanError, match="no tensor-parallel facts"):
        plan(profile(degrees=None), PlanConfig(ranks=2, batch=16, memory=2**40, tp=2))
    with pytest.raises(PlanError, match="plan needs tp as an integer >= 1, got 0"):
        plan(profile(), PlanConfig(ranks=2, batch=16, memory=2**40, tp=0))


def test_tp_facts_round_trip_through_json_and_scale_with_the_microbatch() -> None:
    prof = profile()
    again = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again == prof and again.tp_degrees == (2, 4) and again.parts[0].tp == FACTS
    doubled = prof.at_microbatch(8).parts[0].tp
    assert doubled == TPFacts(2, 4 * 64 * 1024, 4, 8 * 64 * 1024, MIB)  # bytes scale, counts and params do not
    assert prof.grouped(2)[0].tp == TPFacts(4, 4 * 64 * 1024, 8, 8 * 64 * 1024, 2 * MIB)
    mixed = Profile((part(), part(tp=None)), 4)
    assert mixed.grouped(1)[0].tp is None
    data = prof.to_dict()
    data["parts"][0]["tp"]["forward_bytes"] = -1
    with pytest.raises(ProfileError, match=r"parts\[0\]: tp: field 'forward_bytes' must be an integer >= 0"):
        Profile.from_dict(data)
    data = prof.to_dict()
    data["tp_degrees"] = [1, 2]
    with pytest.raises(ProfileError, match="tp_degrees: expected a list of integers from 2 to 64"):
        Profile.from_dict(data)
