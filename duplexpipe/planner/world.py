"""The planner for a fixed world size: every P x D x T factorisation planned (`plan.evaluate`) and ranked together."""

from __future__ import annotations

from dataclasses import replace

from duplexpipe.errors import PlanError
from duplexpipe.planner.plan import Evaluated, PlanConfig, PlanResult, PlanRow, check, evaluate, ranked
from duplexpipe.planner.profile import Profile

Mesh = tuple[int, int, int]
"""(P, D, T): pipeline ranks, data-parallel replicas, tensor-parallel degree."""


def factorisations(world: int, *, pp: int | None = None, dp: int | None = None, tp: int | None = None) -> list[Mesh]:
    """Every (P, D, T) with P x D x T = `world`, those given fixed; ValueError naming the values when there is
    none (a world that does not factor with the fixed degrees) or a value is not an integer >= 1."""
    for name, value in (("world", world), ("pp", pp), ("dp", dp), ("tp", tp)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    divisors = [k for k in range(1, world + 1) if world % k == 0]
    meshes = [(p, d, world // (p * d)) for p in divisors for d in divisors if (world // p) % d == 0]
    chosen = [m for m in meshes if all(fixed is None or fixed == got for fixed, got in zip((pp, dp, tp), m,
                                                                                            strict=True))]
    if not chosen:
        fixed = ", ".join(f"{n}={v}" for n, v in (("pp", pp), ("dp", dp), ("tp", tp)) if v is not None)
        raise ValueError(f"world {world} does not factor as P x D x T with {fixed}")
    return chosen


def mesh_refusal(profile: Profile, config: PlanConfig) -> str | None:
    """Why `config`'s mesh cannot be planned at all (`plan.check`'s reason), or None."""
    try:
        check(profile, config)
    except PlanError as exc:
        return str(exc).splitlines()[0]
    return None


def plan_world(profile: Profile, config: PlanConfig, world: int, *, pp: int | None = None, dp: int | None = None,
               tp: int | None = None) -> PlanResult:
    """Plan every P x D x T = `world` (those of `pp`, `dp`, `tp` given fixed; `config`'s ranks, dp and tp are
    replaced) and rank all their candidates by step time; a mesh that cannot be planned at all (more pipeline
    ranks than profiled parts, a batch that does not split over D, a TP degree the plan cannot shard) is one
    rejected row saying why. `config.cores`, when set, is shared by the whole world: a mesh with D replicas
    gives each C / D (and each pipeline of one TP coordinate C / (D x T)).

    Raises ValueError when the world does not factor with the fixed degrees, PlanError when no candidate fits
    (naming the smallest feasible cap) or no mesh can be planned (naming why).
    """
    evaluated: list[Evaluated] = []
    for p, d, t in factorisations(world, pp=pp, dp=dp, tp=tp):
        cores = config.cores / d if config.cores is not None else None
        mesh = replace(config, ranks=p, dp=d, tp=t, cores=cores)
        why = mesh_refusal(profile, mesh)
        if why is None:
            evaluated += evaluate(profile, mesh)
        else:
            evaluated.append((PlanRow("-", 0, 0, rejected=why, ranks=p, dp=d, tp=t), None))
    return ranked(evaluated, config, world)
