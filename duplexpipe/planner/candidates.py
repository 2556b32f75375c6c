"""The candidates a PlanConfig lets the planner try: schedules with their options, microbatch counts, ZeRO stages,
and the gradient compressions the trainer runs with each stage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from duplexpipe.dp_options.compression import Options
from duplexpipe.dp_options.zero import zero_refusal
from duplexpipe.planner.dp_comm import COMPRESSIONS, ZERO_STAGES, Compression, compression
from duplexpipe.planner.profile import Profile
from duplexpipe.schedules import registry


class CandidateSettings(Protocol):
    """What the candidates are drawn from: the fields of `plan.PlanConfig` they read (see there)."""

    @property
    def ranks(self) -> int: ...
    @property
    def batch(self) -> int: ...
    @property
    def dp(self) -> int: ...
    @property
    def schedules(self) -> tuple[str, ...] | None: ...
    @property
    def microbatches(self) -> tuple[int, ...] | None: ...
    @property
    def chunks(self) -> tuple[int, ...]: ...
    @property
    def zero_stages(self) -> tuple[int, ...] | None: ...
    @property
    def compressions(self) -> tuple[str | Options, ...] | None: ...
    @property
    def refusal(self) -> Callable[[int, Options], str | None] | None: ...


def zero_stages(config: CandidateSettings) -> tuple[int, ...]:
    """The stages to plan: the given ones (else all), only the lowest with D = 1 (the same plan: nothing to shard)."""
    stages = tuple(dict.fromkeys(config.zero_stages)) if config.zero_stages is not None else tuple(ZERO_STAGES)
    return (min(stages),) if config.dp == 1 and stages else stages


def compressions(config: CandidateSettings) -> tuple[Compression, ...]:
    """The allowed methods' table entries, lightest first."""
    if config.compressions is None:
        return tuple(COMPRESSIONS.values())
    chosen = {(method := compression(spec)).name: method for spec in config.compressions}
    return tuple(c for name, c in COMPRESSIONS.items() if name in chosen) + \
        tuple(c for name, c in chosen.items() if name not in COMPRESSIONS)


def accepted(config: CandidateSettings, zero: int) -> tuple[list[Compression], list[str]]:
    """The allowed methods the trainer runs with ZeRO `zero` (lightest first), and why it refuses the others."""
    rule = config.refusal or (lambda stage, options: zero_refusal(stage, options))
    ok, refused = [], []
    for method in compressions(config):
        why = rule(zero, method.options)
        if why is None:
            ok.append(method)
        else:
            refused.append(f"{method.name}: {why}")
    return ok, refused


def microbatch_counts(config: CandidateSettings) -> list[int]:
    """The M values to try: given ones, else divisors of batch/D in [P, 8P] (all up to 8P if none)."""
    if config.microbatches is not None:
        return list(config.microbatches)
    local = config.batch // config.dp
    divisors = [m for m in range(1, local + 1) if local % m == 0]
    wide = [m for m in divisors if config.ranks <= m <= 8 * config.ranks]
    return wide or [m for m in divisors if m <= 8 * config.ranks]


def candidates(profile: Profile, config: CandidateSettings) -> list[tuple[str, dict[str, Any], int, int]]:
    """(schedule name, options, M, ZeRO stage) for every combination to evaluate."""
    names = config.schedules or registry.names()
    out = []
    for name in names:
        variants: list[dict[str, Any]] = [{}]
        if name == "interleaved-1f1b":
            variants = [{"chunks": c} for c in config.chunks]
        elif name == "auto":
            variants = [{"placement": p} for p in ("linear", "v")]
        for options in variants:
            for m in microbatch_counts(config):
                for zero in zero_stages(config):
                    out.append((name, options, m, zero))
    return out


def schedule_label(name: str, options: dict[str, Any]) -> str:
    """How a plan row names a schedule with its options: "interleaved-1f1b(chunks=2)", "auto(v)"."""
    if not options:
        return name
    return f"{name}({', '.join(str(v) for v in options.values())})" if name == "auto" else \
        f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})"
