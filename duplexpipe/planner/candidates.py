"""The candidates a PlanConfig lets the planner try: schedules with their options, microbatch counts, ZeRO stages,
activation checkpointing policies, and the gradient compressions the trainer runs with each stage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from duplexpipe.dp_options.compression import Options
from duplexpipe.dp_options.zero import zero_refusal
from duplexpipe.errors import PlanError
from duplexpipe.planner.dp_comm import COMPRESSIONS, ZERO_STAGES, Compression, Link, compression
from duplexpipe.planner.profile import Profile
from duplexpipe.schedules import registry

CHECKPOINTING = ("off", "selective", "full")
"""The activation-checkpointing policies the planner weighs, lightest first (each saves less and recomputes more
than the one before): "off"; "selective", every stage under the runtime's selective policy (its measured bytes and
recompute, `PartProfile.selective_activation_bytes`); "full", every stage keeping its inputs only."""


def checkpointing_policy(value: object) -> str:
    """A `PlanConfig.checkpointing` value as its policy's name: True is "full", False "off"; PlanError otherwise."""
    if value is True or value is False:
        return "full" if value else "off"
    if isinstance(value, str) and value in CHECKPOINTING:
        return value
    raise PlanError(f"plan needs checkpointing policies among True/False, {', '.join(map(repr, CHECKPOINTING))}; "
                    f"got {value!r}")


def runtime_checkpointing(policy: str) -> bool | str:
    """`PipelineConfig.activation_checkpointing`'s value for a policy: False, "selective", or True (full)."""
    values: dict[str, bool | str] = {"off": False, "selective": "selective", "full": True}
    return values[policy]


def planned_policies(profile: Profile, config: CandidateSettings) -> tuple[str, ...]:
    """The policies of `config` the planner can weigh with `profile`, lightest first: selective only where every
    part has its selective figures measured."""
    chosen = {checkpointing_policy(value) for value in config.checkpointing}
    measured = all(p.selective_activation_bytes is not None and p.selective_recompute_s is not None
                   for p in profile.parts)
    return tuple(p for p in CHECKPOINTING if p in chosen and (p != "selective" or measured))


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
    @property
    def reshard_windows(self) -> tuple[int | None, ...]: ...
    @property
    def checkpointing(self) -> tuple[bool | str, ...]: ...
    @property
    def host_link(self) -> Link | None: ...
    @property
    def offload(self) -> tuple[bool | float, ...]: ...


@dataclass(frozen=True)
class Candidate:
    """One combination to evaluate: a schedule with its options, M, the ZeRO stage and the memory levers."""

    schedule: str
    """Registry name."""
    options: dict[str, Any] = field(compare=False)
    """Its generator's options."""
    microbatches: int
    """M."""
    zero: int
    """ZeRO stage."""
    window: int | None = None
    """ZeRO-3's residency window in stages (None: all of a rank's stages; always None below ZeRO-3)."""
    checkpointing: str = "off"
    """Activation checkpointing of every stage: a policy of `CHECKPOINTING`."""
    offload: bool | float = False
    """Activation offload (`PipelineConfig.activation_offload`'s value): False, a fraction, or True."""

    @property
    def key(self) -> tuple[str, int, int, int | None, str, bool | float]:
        """What tells candidates apart."""
        return schedule_label(self.schedule, self.options), self.microbatches, self.zero, self.window, \
            self.checkpointing, self.offload

    def lighter(self, below: int | None, policies: tuple[str, ...] = CHECKPOINTING,
                offloads: tuple[bool | float, ...] = (False,)) -> Candidate | None:
        """The same candidate with one memory lever less (the next lighter checkpointing policy among `policies`,
        lightest first: full -> selective -> off; else the next smaller offload among `offloads`, smallest first;
        else ZeRO-3's window back to all stages, else ZeRO-3 back to ZeRO `below`, the highest other stage planned),
        or None for one without levers: a lever costs time, so it is tried only where that one is over the cap."""
        at = policies.index(self.checkpointing) if self.checkpointing in policies else 0
        if at:
            return replace(self, checkpointing=policies[at - 1])
        at = offloads.index(self.offload) if self.offload in offloads else 0
        if at:
            return replace(self, offload=offloads[at - 1])
        if self.window is not None:
            return replace(self, window=None)
        if self.zero == 3 and below is not None:
            return replace(self, zero=below)
        return None


def planned_offloads(config: CandidateSettings) -> tuple[bool | float, ...]:
    """The offloads to weigh, smallest first: none, then `config.offload`'s where a host link is known (none
    otherwise: nothing prices the copies); a fraction of 1 is planned as True (all but the next backward's)."""
    if config.host_link is None:
        return (False,)
    fractions = sorted({float(v) for v in config.offload if v is not True and v is not False and v < 1})
    whole = any(v is True or (v is not False and v >= 1) for v in config.offload)
    return (False, *fractions, *((True,) if whole else ()))


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


def candidates(profile: Profile, config: CandidateSettings) -> list[Candidate]:
    """Every combination to evaluate; each one's `Candidate.lighter` comes before it."""
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
                for zero in sorted(zero_stages(config)):
                    windows = tuple(dict.fromkeys(config.reshard_windows)) if zero == 3 else (None,)
                    for window in sorted(windows, key=lambda w: w is not None):
                        for offload in planned_offloads(config):
                            for ckpt in planned_policies(profile, config):
                                out.append(Candidate(name, options, m, zero, window, ckpt, offload))
    return out


def schedule_label(name: str, options: dict[str, Any]) -> str:
    """How a plan row names a schedule with its options: "interleaved-1f1b(chunks=2)", "auto(v)"."""
    if not options:
        return name
    return f"{name}({', '.join(str(v) for v in options.values())})" if name == "auto" else \
        f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})"
