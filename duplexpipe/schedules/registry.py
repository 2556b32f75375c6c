"""Schedule registry: name -> generator, with argument checks and one-line descriptions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from duplexpipe.schedules.generators.auto import auto, check_auto
from duplexpipe.schedules.generators.dualpipe import check_dualpipe, check_dualpipev, dualpipe, dualpipev
from duplexpipe.schedules.generators.gpipe import check_gpipe, gpipe
from duplexpipe.schedules.generators.interleaved import check_interleaved_1f1b, interleaved_1f1b
from duplexpipe.schedules.generators.one_f_one_b import check_one_f_one_b, one_f_one_b
from duplexpipe.schedules.generators.v_shape import check_v_half, check_v_min, v_half, v_min
from duplexpipe.schedules.generators.zero_bubble import check_zb_h1, check_zb_h2, check_zbv, zb_h1, zb_h2, zbv
from duplexpipe.schedules.ir import Schedule
from duplexpipe.schedules.layout import gc_paused


@dataclass(frozen=True)
class Entry:
    """One registered schedule family."""

    generator: Callable[..., Schedule]
    """Builds the compute-only schedule from (num_ranks, num_microbatches, **options)."""
    checker: Callable[..., None]
    """Takes the same arguments and raises ValueError naming a violated constraint."""
    description: str
    """One line for `duplexpipe list` and the compare table."""
    options: tuple[str, ...] = ()
    """Keyword options the generator accepts beyond the two counts."""


REGISTRY: Mapping[str, Entry] = MappingProxyType({
    "gpipe": Entry(gpipe, check_gpipe, "GPipe: every forward, then every backward; M activations per rank"),
    "1f1b": Entry(one_f_one_b, check_one_f_one_b,
                  "1F1B (PipeDream-flush): alternate one forward and one backward; bubble (P-1)(F+B)"),
    "interleaved-1f1b": Entry(
        interleaved_1f1b, check_interleaved_1f1b,
        "Megatron interleaved 1F1B: `chunks` stages per rank (default 2), stage s on rank s mod P; "
        "needs M % P == 0", ("chunks",)),
    "zb-h1": Entry(zb_h1, check_zb_h1,
                   "ZB-H1 zero bubble: 1F1B with B split into I and W, W fills the cool-down; "
                   "bubble (P-1)(F+B-2W), 1F1B's memory"),
    "zb-h2": Entry(zb_h2, check_zb_h2,
                   "ZB-H2 zero bubble: ZB-H1 with 2(P-1-r)+1 warm-up forwards and W deferred by 2r; "
                   "2P-1 activations per rank"),
    "zbv": Entry(zbv, check_zbv, "ZB-V zero bubble: 2P stages in a V shape, B split into I and W"),
    "v-half": Entry(v_half, check_v_half,
                    "V-Half (controllable memory): ZB-V's V with the fastest building block holding at most "
                    "half of 1F1B's activations on every rank"),
    "v-min": Entry(v_min, check_v_min,
                   "V-Min (controllable memory): ZB-V's V with the fastest building block holding at most "
                   "a third of 1F1B's activations on every rank (a longer period: more bubble)"),
    "dualpipe": Entry(dualpipe, check_dualpipe,
                      "DualPipe (DeepSeek-V3): two model copies fed from both ends, overlapped F&B; "
                      "needs P even, M even, M >= 2P"),
    "dualpipev": Entry(dualpipev, check_dualpipev,
                       "DualPipeV: DualPipe's order on one model copy of 2P stages in a V; needs M >= 2P"),
    "auto": Entry(auto, check_auto,
                  "automatic zero-bubble search for given costs (`cost`) under a per-rank activation limit "
                  "(`memory_limit`, default P); `placement` linear or v", ("cost", "memory_limit", "placement",
                                                                             "stage_memory")),
})


def names() -> tuple[str, ...]:
    """The registered schedule names, simplest first."""
    return tuple(REGISTRY)


def entry(name: str) -> Entry:
    """The registry entry for `name`; raises ValueError listing the known names."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(names())}") from None


def _check_options(name: str, options: Mapping[str, Any]) -> Entry:
    found = entry(name)
    unknown = sorted(set(options) - set(found.options))
    if unknown:
        accepted = ", ".join(found.options) or "none"
        raise ValueError(f"schedule {name!r} does not take option(s) {', '.join(unknown)}; "
                         f"it accepts: {accepted}")
    return found


def build(name: str, num_ranks: int, num_microbatches: int, **options: Any) -> Schedule:
    """Build the compute-only schedule `name` for P ranks and M microbatches.

    Raises ValueError for an unknown name, an unknown option or arguments the schedule
    does not accept (the message names the constraint and the values given). The cyclic
    garbage collector is paused while the generator runs (see `layout.gc_paused`).
    """
    generator = _check_options(name, options).generator
    with gc_paused():
        return generator(num_ranks, num_microbatches, **options)


def check(name: str, num_ranks: int, num_microbatches: int, **options: Any) -> str | None:
    """None when `build` would accept these arguments, else its error message.

    An unknown name still raises ValueError: it is a caller's mistake, not a mismatch.
    """
    found = entry(name)
    try:
        _check_options(name, options)
        found.checker(num_ranks, num_microbatches, **options)
    except ValueError as exc:
        return str(exc)
    return None


def describe(name: str) -> str:
    """One line describing schedule `name`."""
    return entry(name).description


def params_per_rank(schedule: Schedule) -> float:
    """Parameters held per rank in units of one model / P: 2.0 for DualPipe, 1.0 for the others.

    Computed as (stages on the rank) * num_ranks / num_groups, the maximum over ranks.
    """
    return max(
        len(schedule.stages_of_rank(r)) * schedule.num_ranks / schedule.num_groups
        for r in range(schedule.num_ranks)
    )
