"""The planner's activation offload: the runtime's offload plan over a timeline, the bytes it takes off a rank's
peak, what its copies cost, and offload planned only where a host link is known."""

from __future__ import annotations

from dataclasses import replace

import pytest

from duplexpipe.errors import PlanError
from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.host_offload import Move, copy_time, moves
from duplexpipe.planner.plan import PlanConfig, plan
from duplexpipe.planner.profile import PartProfile, Profile
from duplexpipe.schedules import registry
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.offload import offload_plan
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.sizes import format_bytes

MIB = 2**20
COSTS = (0.5, 1.0, 0.5)
"""F, B, W of every stage: B = I + W."""


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "interleaved-1f1b", "dualpipev"])
@pytest.mark.parametrize("policy", [0.5, True])
def test_the_moves_are_the_runtimes_offload_plan(name: str, policy: bool | float) -> None:
    schedule = registry.build(name, 4, 8)
    timeline = simulate(schedule, CostModel(stage_costs={s: COSTS for s in range(schedule.num_stages)}))
    done = moves(timeline, policy)
    assert done
    for rank in range(4):
        runtime = offload_plan(lower(schedule).actions[rank], policy).offload_after.values()
        assert {(m.stage, m.microbatch) for m in done if m.rank == rank} == {k for keys in runtime for k in keys}
    assert all(m.start < m.back for m in done)


def test_1f1b_rank_0_offloads_all_but_the_next_and_pays_what_the_compute_does_not_hide() -> None:
    """Rank 0 of 1F1B at P=4, M=8 runs F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4..B7: each forward from the second on
    goes to host after its F (its copy overlapping the next compute) and comes back at the start of the compute
    before its B (overlapping it)."""
    schedule = registry.build("1f1b", 4, 8)
    timeline = simulate(schedule, CostModel(stage_costs={s: COSTS for s in range(4)}))
    events = sorted(timeline.rank_events(0), key=lambda e: e.start)
    start = {e.action.microbatch: e for e in events if str(e.action).endswith(f"F{e.action.microbatch}")}
    first = [m for m in moves(timeline, True) if m.rank == 0]
    overlaps = [(0.5, 0.5), (0.5, 0.5), (1.0, 0.5), (1.0, 0.5), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0)]
    assert [(m.microbatch, m.out_overlap, m.back_overlap) for m in first] == \
        [(mb, *o) for mb, o in zip(range(1, 8), overlaps, strict=True)]
    assert first[0] == Move(0, 0, 1, start[1].end, start[4].start, 0.5, 0.5)
    # a copy of 1 (the bytes over the bandwidth) is hidden behind a B, not behind an F: 1 + 1 + 0.5 + 0.5 on rank 0
    link = Link(bandwidth=8.0)
    assert copy_time(first, [8.0] * 4, link, 4) == pytest.approx(3.0)
    assert copy_time(first, [4.0] * 4, link, 4) == 0.0


def heavy() -> Profile:
    """Four parts at microbatch 2: F 0.5 ms, I 0.5 ms, W 0.5 ms, 16 MiB kept, 1 MiB of parameters and messages."""
    return Profile(tuple(PartProfile(5e-4, 5e-4, 5e-4, 16 * MIB, MIB, MIB, MIB) for _ in range(4)), 2)


def test_offload_is_planned_only_with_a_host_link_and_priced_by_its_copies() -> None:
    base = PlanConfig(ranks=4, batch=16, memory=2**40, schedules=("1f1b",), microbatches=(8,),
                      checkpointing=("off",))
    plain = plan(heavy(), base).best
    assert plain.memory[0].activations == 4 * 16 * MIB  # P forwards live on rank 0
    cap = int(plain.peak_bytes) - 1
    with pytest.raises(PlanError, match="no plan fits"):
        plan(heavy(), replace(base, memory=cap))  # no host link: offload is never a candidate
    fast = plan(heavy(), replace(base, memory=cap, host_link=Link(64 * MIB / 5e-4), offload=(True,)))
    best = fast.best
    assert best.offload is True and best.memory[0].activations == 2 * 16 * MIB  # the nearest and the newest
    assert best.offload_s == 0.0 and best.step_s == plain.step_s  # a copy of 0.25 ms hides behind any compute
    assert fast.to_dict()["best"]["activation_offload"] is True and "all-1" in fast.table().splitlines()[1]
    assert fast.decided.startswith(f"memory: 1f1b M=8 ZeRO 0 needs {format_bytes(plain.peak_bytes)} > ")
    assert fast.decided.endswith(f"fits at {format_bytes(best.peak_bytes)}, +0% step; offload all-1 (copies add 0 ms "
                                 "beyond the compute)")
    slow = plan(heavy(), replace(base, memory=cap, host_link=Link(16 * MIB / 1e-3), offload=(True,))).best
    assert slow.offload_s == pytest.approx(3e-3) and slow.step_s == pytest.approx(plain.step_s + 3e-3)
    assert slow.peak_bytes == best.peak_bytes


def test_offload_comes_before_checkpointing_and_the_plan_says_when_it_was_not_planned() -> None:
    base = PlanConfig(ranks=4, batch=16, memory=2**40, schedules=("1f1b",), microbatches=(8,),
                      checkpointing=("off", "full"))
    plain = plan(heavy(), base).best
    cap = int(plain.peak_bytes) - 1
    linked = plan(heavy(), replace(base, memory=cap, host_link=Link(64 * MIB / 5e-4)))
    # half of the live forwards fit: more offload, and checkpointing, are tried only where less is over the cap
    assert linked.best.offload == 0.5 and linked.best.checkpointing == "off" and linked.best.peak_bytes <= cap
    assert {(r.checkpointing, r.offload) for r in linked.rows} == {("off", False), ("off", 0.5), ("full", False)}
    unlinked = plan(heavy(), replace(base, memory=cap))
    assert unlinked.best.checkpointing == "full" and unlinked.best.offload is False
    assert unlinked.decided.endswith("; activation offload not planned: no host-copy bandwidth known")
    assert f"needs {format_bytes(plain.peak_bytes)}" in unlinked.decided
    with pytest.raises(PlanError, match="offload values must be True .* got 1.5"):
        plan(heavy(), replace(base, offload=(1.5,)))
