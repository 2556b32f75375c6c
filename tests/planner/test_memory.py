"""The byte memory model: sizes as text, a hand-computed 1F1B case, DualPipe's two copies, ZeRO sharding."""

from __future__ import annotations

import pytest

from duplexpipe.planner.memory import MemoryConfig, StageBytes, rank_memory
from duplexpipe.planner.profile import PartProfile
from duplexpipe.schedules import registry
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.sizes import format_bytes, parse_bytes


@pytest.mark.parametrize(("text", "value"), [
    ("40GiB", 40 * 2**30), ("40 GiB", 40 * 2**30), ("512MiB", 512 * 2**20), ("80GB", 80 * 10**9),
    ("1.5e9", 1_500_000_000), ("2kib", 2048), ("7", 7), ("0.5 KiB", 512),
])
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "40 gigs", "4Gx", "-1GiB", "0", "1e999", "nan"])
def test_parse_bytes_rejects_malformed_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="bad memory size"):
        parse_bytes(text)


def test_format_bytes() -> None:
    assert [format_bytes(v) for v in (800, 2048, 3 * 2**20 / 2, 40 * 2**30, 2**41)] == [
        "800 B", "2 KiB", "1.5 MiB", "40 GiB", "2 TiB"]


def sizes_1f1b() -> StageBytes:
    # stage 0 keeps 100 bytes per microbatch, sends 7 and receives 5-byte gradients; stage 1 keeps 10.
    return StageBytes.of(registry.build("1f1b", 2, 2),
                         [PartProfile(1, 1, 1, 100, 1000, 7, 5), PartProfile(1, 1, 1, 10, 2000, 3, 3)])


def test_one_f_one_b_by_hand() -> None:
    schedule = registry.build("1f1b", 2, 2)
    timeline = simulate(schedule, CostModel(f=1, b=2, w=1))
    # rank 0: F0 [0,1) F1 [1,2) B0 [4,6) B1 [7,9); rank 1: F0 [1,2) B0 [2,4) F1 [4,5) B1 [5,7).
    # Activations: rank 0 holds 2 x 100 over [1, 6); rank 1 one of 10 at a time.
    # Messages: F1's output waits on both ranks over [2, 4) (7 bytes); the others are consumed at once.
    r0, r1 = rank_memory(schedule, timeline, sizes_1f1b())
    assert (r0.activations, r0.messages, r1.activations, r1.messages) == (200, 7, 10, 7)
    # params + gradients (x1) + AdamW states (x2), plus the peak of activations + messages together
    assert (r0.params, r0.gradients, r0.optimizer, r0.peak) == (1000, 1000, 2000, 4000 + 207)
    assert r1.peak == 8000 + 17
    assert r0.to_dict()["peak"] == 4207 and r0.rank == 0 and r1.rank == 1


def test_gloo_sends_stay_until_a_reply_proves_them_received() -> None:
    """Timeline as above. Rank 0's F0 message (7 bytes), taken by 1F0 [1, 2), is proven by the reply rank 1 makes
    next, B0's gradient, taken by 0B0 [4, 6): held over [1, 6); F1's, taken by 1F1 [4, 5), by B1's gradient taken
    by 0B1 [7, 9): held over [2, 9). Rank 1's two gradients (5 bytes) get no reply: held to the step's end, 9."""
    schedule = registry.build("1f1b", 2, 2)
    timeline = simulate(schedule, CostModel(f=1, b=2, w=1))
    held = rank_memory(schedule, timeline, sizes_1f1b(), MemoryConfig(sends_held=True))
    plain = rank_memory(schedule, timeline, sizes_1f1b())
    assert (held[0].messages, plain[0].messages) == (7 + 7, 7)
    assert (held[1].messages, plain[1].messages) == (5 + 5, 7)  # over [7, 9) both gradients; F1's input [2, 4)
    assert held[0].peak == plain[0].peak + 7


def test_gloo_receives_are_held_from_their_post_two_ahead() -> None:
    """Rank 1 takes rank 0's F0 at 1F0 [1, 2) and F1 at 1F1 [4, 5); posted one ahead, F1's buffer (7 bytes) is held
    from when F0 was taken (1), beside F0's (from the step's start); the gradients back to rank 0 likewise."""
    schedule = registry.build("1f1b", 2, 2)
    timeline = simulate(schedule, CostModel(f=1, b=2, w=1))
    ahead = rank_memory(schedule, timeline, sizes_1f1b(), MemoryConfig(receives_ahead=1))
    plain = rank_memory(schedule, timeline, sizes_1f1b())
    assert (ahead[1].messages, plain[1].messages) == (7 + 7, 7)
    assert ahead[0].messages == 7 + 5 + 5  # F1's send waiting over [2, 4), both gradients' buffers from the start
    with pytest.raises(ValueError, match="receives_ahead"):
        MemoryConfig(receives_ahead=-1)


def test_the_gloo_receives_ahead_are_the_runtimes() -> None:
    from duplexpipe.planner.memory import GLOO_RECEIVES_AHEAD
    from duplexpipe.runtime.config import RuntimeConfig

    assert RuntimeConfig().recv_lookahead == GLOO_RECEIVES_AHEAD


def test_zero_stages_shard_the_optimizer_and_hold_gradients_whole_during_the_step() -> None:
    """ZeRO-1 and up keep 1/D of the optimizer state; gradients stay whole until the step's one reduce-scatter
    per stage at every stage (as the runtime measures them); ZeRO-2 on FSDP2 keeps the 1/D parameter shards beside
    the whole parameters, ZeRO-3 the shards and the stages unsharded at once (here all: no window)."""
    schedule = registry.build("1f1b", 2, 2)
    timeline = simulate(schedule, CostModel(f=1, b=2, w=1))
    peaks = [rank_memory(schedule, timeline, sizes_1f1b(), MemoryConfig(zero_stage=z, dp=4))[0] for z in (0, 1, 2, 3)]
    assert [(m.params, m.gradients, m.optimizer) for m in peaks] == [
        (1000, 1000, 2000), (1000, 1000, 500), (1250, 1000, 500), (1250, 1000, 500)]
    sgd = rank_memory(schedule, timeline, sizes_1f1b(), MemoryConfig(optimizer_factor=1.0))[0]
    assert sgd.optimizer == 1000


def test_dualpipe_holds_two_copies_of_parameters() -> None:
    schedule = registry.build("dualpipe", 4, 8)
    parts = [PartProfile(1, 1, 1, 10, 100 * (k + 1), 1, 1) for k in range(4)]
    timeline = simulate(schedule, CostModel(f=1, b=2, w=1))
    memory = rank_memory(schedule, timeline, StageBytes.of(schedule, parts))
    # rank r holds parts r and P-1-r
    assert [m.params for m in memory] == [100 + 400, 200 + 300, 300 + 200, 400 + 100]
    one = registry.build("1f1b", 4, 8)
    single = rank_memory(one, simulate(one, CostModel()), StageBytes.of(one, parts))
    assert [m.params for m in single] == [100, 200, 300, 400]


def test_a_recompute_is_held_through_its_backward_and_from_i_to_w() -> None:
    """A checkpointed stage keeping 1 byte (its input) and recomputing 9 more: under 1F1B the 9 live only inside a
    B; under ZB-H1 from each I to its W."""
    parts = [PartProfile(1, 1, 1, 1, 0, 0, 0)] * 2
    cost = CostModel(f=1, b=2, w=1)
    one, zb = registry.build("1f1b", 2, 4), registry.build("zb-h1", 2, 4)
    plain = rank_memory(one, simulate(one, cost), StageBytes.of(one, parts, (9, 9)))
    # rank 0's first B recomputes with two inputs held; rank 1 holds one input at a time
    assert [m.activations for m in plain] == [2 + 9, 1 + 9]
    split = rank_memory(zb, simulate(zb, cost), StageBytes.of(zb, parts, (9, 9)))
    # rank 1 runs 1F0 1I0 1F1 1I1 1W0: at 1I1 it holds microbatch 0's recompute (its W pending), microbatch 1's,
    # and both inputs
    assert [m.activations for m in split] == [2 + 9, 2 + 2 * 9]
    assert [m.peak for m in split] == [m.params + m.gradients + m.optimizer + m.activations for m in split]


def test_activation_peak_matches_the_timeline_count_when_every_stage_weighs_one() -> None:
    for name in ("zb-h1", "zbv", "dualpipev", "interleaved-1f1b"):
        schedule = registry.build(name, 4, 8)
        timeline = simulate(schedule, CostModel(f=1, b=2, w=1, latency=0.3))
        parts = [PartProfile(1, 1, 1, 1, 0, 0, 0)] * schedule.num_groups
        memory = rank_memory(schedule, timeline, StageBytes.of(schedule, parts))
        assert [m.activations for m in memory] == [timeline.peak_activations(r) for r in range(4)]


def test_bad_configs_and_mismatched_parts() -> None:
    with pytest.raises(ValueError, match="unknown ZeRO stage 4"):
        MemoryConfig(zero_stage=4)
    with pytest.raises(ValueError, match="dp must be an integer >= 1"):
        MemoryConfig(dp=0)
    with pytest.raises(ValueError, match="optimizer_factor must be a finite number >= 0"):
        MemoryConfig(optimizer_factor=-1)
    with pytest.raises(ValueError, match="'zbv' has 8 model parts, got 4 part profiles"):
        StageBytes.of(registry.build("zbv", 4, 8), [PartProfile(1, 1, 1, 1, 1, 1, 1)] * 4)
