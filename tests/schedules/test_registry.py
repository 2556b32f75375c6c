"""Tests for the schedule registry, every generator's completeness, golden grids and verification."""

from __future__ import annotations

import gc
import importlib.util
import os
from collections import Counter
from pathlib import Path
from types import MappingProxyType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplexpipe.schedules import registry
from duplexpipe.schedules.generators._common import RowBuilder
from duplexpipe.schedules.ir import Op, Schedule, format_action

GOLDEN = Path(__file__).parents[1] / "golden"
REGEN_VAR = "DUPLEXPIPE_REGEN"
HAVE_VERIFY = importlib.util.find_spec("duplexpipe.schedules.verify") is not None
HAVE_SIMULATE = importlib.util.find_spec("duplexpipe.schedules.simulate") is not None
EXPECTED_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min", "dualpipe",
                  "dualpipev", "auto")
HANDMADE = EXPECTED_NAMES[:-1]
"""Every name but auto, whose output depends on its search (tests/schedules/generators/test_auto.py covers it)."""
GOLDEN_CASES = [(name, 4, 8) for name in HANDMADE] + [
    ("zbv", 4, 3), ("dualpipe", 6, 12), ("dualpipev", 3, 6), ("1f1b", 4, 2),
]


def grid_text(schedule: Schedule) -> str:
    """One line per rank, actions in their text form separated by spaces."""
    return "".join(" ".join(format_action(a) for a in row) + "\n" for row in schedule.actions)


def valid_microbatches(name: str, num_ranks: int, upto: int = 64) -> list[int]:
    """Every M in 1..upto that schedule `name` accepts on `num_ranks` ranks."""
    return [m for m in range(1, upto + 1) if registry.check(name, num_ranks, m) is None]


def assert_complete(s: Schedule) -> None:
    """Every (stage, microbatch) has one F and one B (or one I then one W) on the stage's rank, in order."""
    where: dict[tuple[int, Op, int], tuple[int, int]] = {}
    counts: Counter[tuple[int, Op, int]] = Counter()
    for rank, pos, action in s.iter_actions():
        assert not action.op.is_comm, f"compute-only schedule holds {action} on rank {rank}"
        for part in action.compute_parts():
            key = (part.stage, part.op, part.microbatch)
            counts[key] += 1
            where[key] = (rank, pos)
            assert s.stages[part.stage].rank == rank, f"{part} runs on rank {rank}, not its stage's rank"
    expected = 0
    for stage in range(s.num_stages):
        for m in s.microbatches_of_stage(stage):
            f, b, i, w = ((stage, op, m) for op in (Op.F, Op.B, Op.I, Op.W))
            assert counts[f] == 1, f"stage {stage} microbatch {m}: {counts[f]} forwards"
            if counts[b]:
                assert counts[b] == 1 and not counts[i] and not counts[w], f"stage {stage} mb {m}: B and I/W"
                assert where[f] < where[b], f"stage {stage} mb {m}: B before F"
                expected += 2
            else:
                assert counts[i] == 1 and counts[w] == 1, f"stage {stage} mb {m}: no B and no I+W"
                assert where[f] < where[i] < where[w], f"stage {stage} mb {m}: F, I, W out of order"
                expected += 3
    assert sum(counts.values()) == expected, "the lists hold actions for unknown (stage, microbatch)"


def test_names_order_and_mapping_is_immutable() -> None:
    assert registry.names() == EXPECTED_NAMES
    assert isinstance(registry.REGISTRY, MappingProxyType)
    with pytest.raises(TypeError):
        registry.REGISTRY["x"] = registry.REGISTRY["gpipe"]  # type: ignore[index]


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_build_names_the_schedule_and_describe_is_one_line(name: str) -> None:
    s = registry.build(name, 4, 8)
    assert s.name == name and s.num_ranks == 4 and s.num_microbatches == 8
    text = registry.describe(name)
    assert text and "\n" not in text


def test_unknown_name_lists_known_names() -> None:
    for call in (lambda: registry.build("pipedream", 2, 2), lambda: registry.describe("x"),
                 lambda: registry.check("x", 2, 2)):
        with pytest.raises(ValueError, match="known schedules: gpipe, 1f1b, interleaved-1f1b"):
            call()


def test_options_are_passed_and_unknown_options_rejected() -> None:
    s = registry.build("interleaved-1f1b", 2, 4, chunks=3)
    assert s.num_stages == 6
    with pytest.raises(ValueError, match="'gpipe' does not take option.*chunks"):
        registry.build("gpipe", 2, 4, chunks=2)
    assert "chunks" in str(registry.check("1f1b", 2, 4, chunks=2))


@pytest.mark.parametrize(("name", "ranks", "mbs", "needle"), [
    ("dualpipe", 3, 8, "even number of ranks, got num_ranks=3"),
    ("dualpipe", 4, 9, "even number of microbatches, got num_microbatches=9"),
    ("dualpipe", 4, 6, "num_microbatches >= 2 * num_ranks, got num_microbatches=6, num_ranks=4"),
    ("dualpipev", 3, 5, "num_microbatches >= 2 * num_ranks, got num_microbatches=5, num_ranks=3"),
    ("interleaved-1f1b", 4, 6, "multiple of num_ranks, got num_microbatches=6, num_ranks=4"),
    ("zbv", 1, 4, "num_ranks >= 2, got num_ranks=1"),
    ("gpipe", 2, 0, "num_microbatches >= 1, got num_microbatches=0"),
])
def test_check_matches_build(name: str, ranks: int, mbs: int, needle: str) -> None:
    message = registry.check(name, ranks, mbs)
    assert message is not None and needle in message
    with pytest.raises(ValueError) as info:
        registry.build(name, ranks, mbs)
    assert str(info.value) == message


def test_check_is_none_exactly_when_build_succeeds() -> None:
    for name in EXPECTED_NAMES:
        for ranks in range(1, 7):
            for mbs in range(1, 15):
                message = registry.check(name, ranks, mbs)
                if message is None:
                    registry.build(name, ranks, mbs)
                else:
                    with pytest.raises(ValueError):
                        registry.build(name, ranks, mbs)


def test_build_pauses_the_garbage_collector_and_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    gpipe = registry.entry("gpipe").generator

    def probe(num_ranks: int, num_microbatches: int) -> Schedule:
        seen.append(gc.isenabled())
        if num_microbatches == 0:
            raise ValueError("probe: no microbatches")
        return gpipe(num_ranks, num_microbatches)

    table = MappingProxyType({"probe": registry.Entry(probe, lambda p, m: None, "a probe")})
    monkeypatch.setattr(registry, "REGISTRY", table)
    was_enabled = gc.isenabled()
    try:
        gc.enable()
        assert registry.build("probe", 2, 2).num_stages == 2
        with pytest.raises(ValueError, match="probe: no microbatches"):
            registry.build("probe", 2, 0)
        assert seen == [False, False] and gc.isenabled()
        gc.disable()
        registry.build("probe", 2, 2)
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        (gc.enable if was_enabled else gc.disable)()


def test_params_per_rank() -> None:
    got = {name: registry.params_per_rank(registry.build(name, 4, 8)) for name in EXPECTED_NAMES}
    assert got == {name: (2.0 if name == "dualpipe" else 1.0) for name in EXPECTED_NAMES}


def test_row_builder_weight_order_and_leftovers() -> None:
    b = RowBuilder({0: range(3), 5: range(2, 4)})
    b.backward(5, split=True)
    b.backward(0, split=True)
    b.backward(0)
    b.weight(0)
    b.weight()
    assert [format_action(a) for a in b.actions] == ["5I2", "0I0", "0B1", "0W0", "5W2"]
    with pytest.raises(RuntimeError, match="no deferred weight gradient left"):
        b.weight()
    b.backward(0, split=True)
    with pytest.raises(RuntimeError, match=r"never emitted: \[\(0, 2\)\]"):
        b.finish()


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_every_valid_small_case_is_complete(name: str) -> None:
    for ranks in range(1, 9):
        for mbs in valid_microbatches(name, ranks, upto=2 * ranks + 5):
            assert_complete(registry.build(name, ranks, mbs))


@pytest.mark.parametrize(("name", "ranks", "mbs"), GOLDEN_CASES)
def test_golden_grid(name: str, ranks: int, mbs: int) -> None:
    """Compare with tests/golden/<name>_p<P>_m<M>.txt; DUPLEXPIPE_REGEN=1 rewrites the files."""
    path = GOLDEN / f"{name}_p{ranks}_m{mbs}.txt"
    text = grid_text(registry.build(name, ranks, mbs))
    if os.environ.get(REGEN_VAR) == "1":
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"{path} is missing; run with {REGEN_VAR}=1 to create it"
    assert text == path.read_text(encoding="utf-8"), f"{name} P={ranks} M={mbs} differs from {path}"


@st.composite
def schedule_case(draw: st.DrawFn) -> tuple[str, int, int]:
    """A registered name, P in 2..16 and an M in 1..64 that the schedule accepts."""
    name = draw(st.sampled_from(EXPECTED_NAMES))
    ranks = draw(st.integers(2, 16))
    choices = valid_microbatches(name, ranks)
    if not choices:
        ranks = 2
        choices = valid_microbatches(name, ranks)
    return name, ranks, draw(st.sampled_from(choices))


@pytest.mark.skipif(not HAVE_VERIFY, reason="duplexpipe.schedules.verify not written yet")
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule_case())
def test_every_generator_passes_the_verifier(case: tuple[str, int, int]) -> None:
    from duplexpipe.schedules.verify import verify

    name, ranks, mbs = case
    schedule = registry.build(name, ranks, mbs)
    assert_complete(schedule)
    verify(schedule)


# DeepSeek-V3 Table 2 with F=1, B=2, W=1, F&B=3 and zero comm cost: idle time of every rank.
REFERENCE_IDLE = {
    "1f1b": lambda p: (p - 1) * (1 + 2),
    "zb-h1": lambda p: (p - 1) * (1 + 2 - 2 * 1),
    "dualpipe": lambda p: (p // 2 - 1) * (3 + 2 - 3 * 1),
    "dualpipev": lambda p: (p - 1) * (3 + 2 - 3 * 1),
}


@pytest.mark.skipif(not HAVE_SIMULATE, reason="duplexpipe.schedules.simulate not written yet")
@pytest.mark.parametrize("name", sorted(REFERENCE_IDLE))
def test_reference_bubbles_on_every_rank(name: str) -> None:
    from duplexpipe.schedules.simulate import CostModel, simulate

    cost = CostModel(f=1.0, b=2.0, w=1.0, fb=3.0)
    for ranks in (2, 4, 6, 8):
        for mbs in (2 * ranks, 3 * ranks + 2):
            timeline = simulate(registry.build(name, ranks, mbs), cost)
            idle = [timeline.idle(r) for r in range(ranks)]
            assert idle == [pytest.approx(REFERENCE_IDLE[name](ranks))] * ranks, (name, ranks, mbs, idle)
