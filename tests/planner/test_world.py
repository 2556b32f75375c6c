"""The planner for a world size: every P x D x T factorisation, those that cannot run rejected with a reason, all
candidates ranked together, and a world that does not factor with the fixed degrees refused."""

from __future__ import annotations

import pytest

from duplexpipe.errors import PlanError
from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.plan import PlanConfig
from duplexpipe.planner.profile import PartProfile, Profile, TPFacts
from duplexpipe.planner.world import factorisations, plan_world

MIB = 2**20


def profile(parts: int = 4, compute_s: float = 1e-3, degrees: tuple[int, ...] = (2, 4)) -> Profile:
    facts = TPFacts(2, 2 * 64 * 1024, 4, 4 * 64 * 1024, MIB)
    return Profile(tuple(PartProfile(compute_s, compute_s, compute_s, MIB, 8 * MIB, 64 * 1024, 64 * 1024, tp=facts)
                         for _ in range(parts)), 4, tp_degrees=degrees)


def config(**changes: object) -> PlanConfig:
    base: dict[str, object] = {"ranks": 1, "batch": 16, "memory": 2**40, "schedules": ("1f1b",)}
    base.update(changes)
    return PlanConfig(**base)  # type: ignore[arg-type]


def test_the_factorisations_of_a_world() -> None:
    assert factorisations(4) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    assert factorisations(8, tp=2) == [(1, 4, 2), (2, 2, 2), (4, 1, 2)]
    assert factorisations(8, pp=2, dp=2) == [(2, 2, 2)]
    assert factorisations(1) == [(1, 1, 1)]
    assert len(factorisations(12)) == 18  # ordered triples with product 12


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"world": 6, "tp": 4}, "world 6 does not factor as P x D x T with tp=4"),
    ({"world": 8, "pp": 3, "dp": 1}, "world 8 does not factor as P x D x T with pp=3, dp=1"),
    ({"world": 0}, "world must be an integer >= 1, got 0"),
    ({"world": 4, "tp": 0}, "tp must be an integer >= 1, got 0"),
])
def test_a_world_that_does_not_factor_is_refused(kwargs: dict[str, int], needle: str) -> None:
    world = kwargs.pop("world")
    with pytest.raises(ValueError, match=needle):
        factorisations(world, **kwargs)


def test_every_mesh_is_planned_and_ranked_together() -> None:
    result = plan_world(profile(), config(), 4)
    meshes = {r.mesh for r in result.rows}
    assert meshes == {"1x1x4", "1x2x2", "1x4x1", "2x1x2", "2x2x1", "4x1x1"}
    fits = [r for r in result.rows if r.feasible]
    assert [r.step_s for r in fits] == sorted(r.step_s for r in fits)
    best = result.best
    assert (result.config.ranks, result.config.dp, result.config.tp) == (best.ranks, best.dp, best.tp)
    assert result.world == 4 and result.to_dict()["world"] == 4
    assert result.schedule is not None and result.schedule.num_ranks == best.ranks
    assert "PxDxT" in result.table().splitlines()[0]


def test_a_mesh_that_cannot_run_is_one_rejected_row_saying_why() -> None:
    result = plan_world(profile(parts=2), config(batch=6), 4)
    why = {r.mesh: r.rejected for r in result.rows if r.schedule == "-"}
    assert "the profile has 2 parts, but 4 ranks need at least 4" in why["4x1x1"]
    assert "batch 6 does not split over dp=4 replicas" in why["1x4x1"]
    assert all(r.feasible for r in result.rows if r.mesh in ("1x1x4", "2x1x2", "1x2x2", "2x2x1"))
    with pytest.raises(PlanError, match="no candidate can run: the TP plan cannot shard the model at tp=4"):
        plan_world(profile(degrees=(2,)), config(), 4, tp=4)


def test_a_slow_tp_link_moves_the_choice_away_from_tp_and_a_fast_one_towards_it() -> None:
    heavy = profile(compute_s=20e-3)  # compute-bound parts: dividing them pays while the link is fast
    fast = plan_world(heavy, config(tp_link=Link(1e12)), 4, dp=1)
    slow = plan_world(heavy, config(tp_link=Link(1e6)), 4, dp=1)
    assert fast.best.tp > 1 and slow.best.tp == 1


def test_shared_cores_are_split_over_the_replicas_and_tp_ranks() -> None:
    result = plan_world(profile(), config(cores=2), 4, tp=1)
    replicas = {r.mesh: r for r in result.rows if r.feasible}
    alone = plan_world(profile(), config(), 4, tp=1)
    assert all(replicas[m].step_s >= r.step_s for m, r in ((r.mesh, r) for r in alone.rows if r.feasible))


def test_nothing_fits_names_the_smallest_cap_and_its_mesh() -> None:
    with pytest.raises(PlanError, match=r"smallest feasible cap is .* P x D x T = 4x1x1") as info:
        plan_world(profile(), config(memory=MIB), 4)
    assert info.value.smallest_cap is not None
