"""Tests of the simulator: docs/design.md's bubble table, hand-timed comm cases, the cost model and summary."""

from __future__ import annotations

import math

import pytest

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import Op, Schedule, StageInfo, parse_action
from duplexpipe.schedules.simulate import CostModel, simulate, summary
from duplexpipe.schedules.timeline import Timeline

TABLE = CostModel(f=1.0, b=2.0, w=1.0, fb=3.0)  # docs/design.md: zero comm cost, F=1 B=2 W=1 F&B=3


def make(rows: list[str], stages: list[int], microbatches: int) -> Schedule:
    table = tuple(StageInfo(rank, s) for s, rank in enumerate(stages))
    acts = tuple(tuple(parse_action(t) for t in row.split()) for row in rows)
    return Schedule("hand", len(rows), microbatches, table, acts)


def spans(timeline: Timeline) -> dict[str, tuple[float, float]]:
    return {str(e.action): (e.start, e.end) for e in timeline.events}


# docs/design.md's per-rank bubble (idle time) with F=1, B=2, W=1, F&B=3
IDLE = {
    "1f1b": lambda p: (p - 1) * (1 + 2),
    "zb-h1": lambda p: (p - 1) * (1 + 2 - 2 * 1),
    "dualpipe": lambda p: (p // 2 - 1) * (3 + 2 - 3 * 1),
    "dualpipev": lambda p: (p - 1) * (3 + 2 - 3 * 1),  # DualPipeV on p ranks = DualPipe's P/2
}
CASES = [(name, p, m) for name in IDLE for p, m in [(2, 4), (4, 8), (4, 20), (6, 12), (6, 18), (8, 16),
                                                     (8, 40)]
         if registry.check(name, p, m) is None]


@pytest.mark.parametrize("name,ranks,microbatches", CASES)
def test_idle_per_rank_matches_design_table(name: str, ranks: int, microbatches: int) -> None:
    tl = simulate(registry.build(name, ranks, microbatches), TABLE)
    expected = IDLE[name](ranks)
    assert [tl.idle(r) for r in range(ranks)] == pytest.approx([expected] * ranks)
    work = sum(e.duration for e in tl.events)
    assert tl.makespan == pytest.approx((work + ranks * expected) / ranks)


@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8), (8, 16), (8, 3)])
def test_1f1b_holds_p_minus_r_activations(ranks: int, microbatches: int) -> None:
    tl = simulate(registry.build("1f1b", ranks, microbatches), TABLE)
    assert [tl.peak_activations(r) for r in range(ranks)] == [min(ranks - r, microbatches)
                                                            for r in range(ranks)]


@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8), (4, 20), (6, 12), (8, 16), (8, 24)])
def test_dualpipe_holds_at_most_p_plus_1_activations(ranks: int, microbatches: int) -> None:
    tl = simulate(registry.build("dualpipe", ranks, microbatches), TABLE)
    assert max(tl.peak_activations(r) for r in range(ranks)) <= ranks + 1


def test_events_cover_each_compute_action_once() -> None:
    s = registry.build("dualpipe", 4, 8)
    tl = simulate(s, TABLE)
    assert sorted(str(e.action) for e in tl.events) == sorted(str(a) for row in s.actions for a in row)
    assert all(not e.action.op.is_comm for e in tl.events)
    for r in range(4):
        ev = tl.rank_events(r)
        assert [e.action for e in ev] == list(s.actions[r])  # in list order, never overlapping
        assert all(a.end <= b.start for a, b in zip(ev, ev[1:], strict=False))
    pairs = [e for e in tl.events if e.action.op is Op.OVERLAP_F_B]
    assert pairs and all(e.duration == (3.0 if e.action.parts[1].op is Op.B else 2.0) for e in pairs)


def test_one_message_by_hand() -> None:
    # message time = latency + bytes / bandwidth = 0.5 + 100 / 200 = 1
    cost = CostModel(latency=0.5, activation_bytes=100.0, bandwidth=200.0)
    tl = simulate(make(["0F0 0B0", "1F0 1B0"], [0, 1], 1), cost)
    assert spans(tl) == {"0F0": (0, 1), "1F0": (2, 3), "1B0": (3, 5), "0B0": (6, 8)}
    assert tl.makespan == 8


RANK0 = "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"


def test_a_transfer_waits_for_the_receive_to_be_posted() -> None:
    # latency 1; rank 1 posts both receives at time 0
    early = make([RANK0, "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1"], [0, 1], 2)
    assert spans(simulate(early, CostModel(latency=1.0))) == {
        "0F0": (0, 1), "0F1": (1, 2), "1F0": (2, 3), "1B0": (3, 5), "1F1": (5, 6), "1B1": (6, 8),
        "0B0": (6, 8), "0B1": (9, 11)}  # 0RECV_B1 is posted at 8, after 0B0: 8 + 1
    # posting 1RECV_F1 only after 1B0 (at 5) delays microbatch 1's input to 5 + 1
    late = make([RANK0, "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"], [0, 1], 2)
    got = spans(simulate(late, CostModel(latency=1.0)))
    assert got["1F1"] == (6, 7) and got["1B1"] == (7, 9) and got["0B1"] == (10, 12)


def test_lowered_1f1b_with_latency_by_hand() -> None:
    # 1F1B, 2 ranks, 4 microbatches, messages take 0.5. Rank 1 posts 1RECV_F1 before 1B0 (at 2.5),
    # so 0F1's output (sent at 2) lands at 3, before rank 1 is free at 4.5; the steady state then
    # pays one message per direction per microbatch on the critical path.
    tl = simulate(registry.build("1f1b", 2, 4), CostModel(latency=0.5))
    got = {(e.rank, str(e.action)): (e.start, e.end) for e in tl.events}
    assert got[(1, "1F0")] == (1.5, 2.5) and got[(1, "1B0")] == (2.5, 4.5)
    assert got[(0, "0B0")] == (5, 7) and got[(1, "1F1")] == (4.5, 5.5)
    assert got[(0, "0B1")] == (8, 10) and got[(1, "1F2")] == (8.5, 9.5)
    assert got[(0, "0B3")] == (15, 17) and tl.makespan == 17


def test_overlap_pair_is_one_unit() -> None:
    # one rank, two stages: (0F1;1B0) runs as one event
    s = make(["0F0 1F0 (0F1;1B0)OVERLAP_F_B 1F1 1B1 0B0 0B1"], [0, 0], 2)
    assert spans(simulate(s, CostModel()))["(0F1;1B0)OVERLAP_F_B"] == (2, 5)
    assert spans(simulate(s, CostModel(fb=2.5)))["(0F1;1B0)OVERLAP_F_B"] == (2, 4.5)
    split = make(["0F0 1F0 (0F1;1I0)OVERLAP_F_B 1W0 1F1 1B1 0B0 0B1"], [0, 0], 2)
    assert spans(simulate(split, CostModel(fb=2.5)))["(0F1;1I0)OVERLAP_F_B"] == (2, 3.5)  # fb - w
    assert spans(simulate(split, CostModel()))["(0F1;1I0)OVERLAP_F_B"] == (2, 4)  # f + (b - w)


def test_pair_waits_for_both_inputs() -> None:
    # rank 1's pair needs 0F1 (arrives at 2 + 1) and 2B0's gradient (sent at 7, arrives at 8)
    s = make(["0F0 0F1 0B0 0B1", "1F0 (1F1;1B0)OVERLAP_F_B 1B1", "2F0 2B0 2F1 2B1"], [0, 1, 2], 2)
    tl = simulate(s, CostModel(latency=1.0))
    got = spans(tl)
    assert got["1F0"] == (2, 3) and got["2F0"] == (4, 5) and got["2B0"] == (5, 7)
    assert got["(1F1;1B0)OVERLAP_F_B"] == (8, 11) and got["2F1"] == (12, 13)


def test_stage_costs_and_stage_scale() -> None:
    s = make(["0F0 0B0", "1F0 1B0"], [0, 1], 1)
    got = spans(simulate(s, CostModel(stage_costs={1: (4.0, 6.0, 1.0)})))
    assert got == {"0F0": (0, 1), "1F0": (1, 5), "1B0": (5, 11), "0B0": (11, 13)}
    # DualPipeV cuts the model into 2P parts: with stage_scale each part costs half
    tl = simulate(registry.build("dualpipev", 2, 4), CostModel(stage_scale=True))
    assert {e.duration for e in tl.events if e.action.op is Op.F} == {0.5}
    one = simulate(registry.build("1f1b", 4, 8), CostModel(stage_scale=True))
    assert one.makespan == simulate(registry.build("1f1b", 4, 8)).makespan
    with pytest.raises(ValueError, match="stage_costs names stages \\[5\\]"):
        simulate(s, CostModel(stage_costs={5: (1.0, 2.0, 1.0)}))


@pytest.mark.parametrize("name", ["1f1b", "dualpipe", "zbv"])
def test_makespan_grows_with_message_cost(name: str) -> None:
    s = registry.build(name, 4, 8)
    spans_ = [simulate(s, CostModel(latency=lat)).makespan for lat in (0.0, 0.25, 1.0, 4.0)]
    assert spans_ == sorted(spans_) and spans_[-1] > spans_[0]


def test_stuck_schedule_raises() -> None:
    s = make(["0F0 0RECV_B0 0B0 0SEND_F0", "1RECV_F0 1F0 1B0 1SEND_B0"], [0, 1], 1)
    with pytest.raises(ScheduleError, match="rank 0 blocked at 0B0 waiting for 1SEND_B0"):
        simulate(s)
    with pytest.raises(ScheduleError, match="0B0"):
        simulate(make(["0B0 0F0"], [0], 1))


def test_summary_matches_the_timeline() -> None:
    tl = simulate(registry.build("1f1b", 4, 8), TABLE)
    out = summary(tl)
    assert set(out) == {"makespan", "bubble_ratio", "per_rank"}
    assert out["makespan"] == tl.makespan == 33
    assert out["bubble_ratio"] == pytest.approx(tl.bubble_ratio) == pytest.approx(36 / (4 * 33))
    assert [row["rank"] for row in out["per_rank"]] == [0, 1, 2, 3]
    for row in out["per_rank"]:
        r = row["rank"]
        assert (row["busy"], row["idle"], row["peak_activations"]) == (tl.busy(r), tl.idle(r),
                                                                       tl.peak_activations(r))


def test_parse_cost_model() -> None:
    c = CostModel.parse("F=1.5, b=3,W=0.5,F&B=4,latency=0.1,bandwidth=1e9,bytes=2e6,stage_scale=yes")
    assert (c.f, c.b, c.w, c.fb, c.latency, c.bandwidth, c.activation_bytes, c.stage_scale) == (
        1.5, 3.0, 0.5, 4.0, 0.1, 1e9, 2e6, True)
    assert c.comm_time == pytest.approx(0.1 + 2e6 / 1e9)
    assert CostModel.parse("") == CostModel()
    assert CostModel.parse("FB=3") == CostModel(fb=3.0)
    assert hash(CostModel.parse("")) == hash(CostModel())  # usable as a dict key
    assert {CostModel(stage_costs={1: (1, 2, 1)}): "x"}[CostModel(stage_costs={1: (1.0, 2.0, 1.0)})] == "x"
    assert CostModel().comm_time == 0.0 and CostModel(bandwidth=math.inf, activation_bytes=5).comm_time == 0


@pytest.mark.parametrize("text,needle", [
    ("Q=1", "'Q'"), ("F=abc", "'abc'"), ("F", "'F'"), ("=3", "'=3'"), ("F=1,F=2", "twice"),
    ("F=nan", "'nan'"), ("F=-1", "-1"), ("W=3", "exceeds b"), ("bandwidth=0", "bandwidth"),
    ("latency=inf", "latency"), ("stage_scale=maybe", "'maybe'"),
])
def test_bad_cost_text_names_the_key_or_value(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        CostModel.parse(text)
    assert needle in str(err.value)


def test_cost_model_rejects_bad_stage_costs() -> None:
    with pytest.raises(ValueError, match="stage_costs\\[1\\]"):
        CostModel(stage_costs={1: (1.0, 2.0)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="stage_costs\\[0\\]: w=3"):
        CostModel(stage_costs={0: (1.0, 2.0, 3.0)})
    with pytest.raises(ValueError, match="-2"):
        CostModel(stage_costs={-2: (1.0, 2.0, 1.0)})
    frozen = CostModel(stage_costs={0: (1, 2, 1)})
    with pytest.raises(TypeError):
        frozen.stage_costs[1] = (1.0, 1.0, 1.0)  # type: ignore[index]
    assert frozen.to_dict()["stage_costs"] == {"0": [1.0, 2.0, 1.0]}


ZERO3 = CostModel(param_bytes=100.0, dp=4, dp_bandwidth=150.0)
"""One stage's all-gather or reduce-scatter moves 75 bytes at 150 per unit: 0.5 units."""


def _zero3(window: int, lookahead: int, name: str = "zbv") -> Timeline:
    from duplexpipe.schedules.shard import add_unshard_reshard

    return simulate(add_unshard_reshard(registry.build(name, 2, 4), window, lookahead), ZERO3)


def test_collectives_cost_bytes_over_bandwidth_and_sit_on_their_lane() -> None:
    tl = _zero3(2, 0)
    gathers = [s for s in tl.spans if s.lane == "fsdp" and s.rank == 0]
    assert [s.name for s in gathers] == ["0UNSHARD", "3UNSHARD", "3REDUCE_GRAD", "0REDUCE_GRAD"]
    assert all(s.end - s.start == pytest.approx(0.5) for s in gathers)
    assert ZERO3.collective_times(registry.build("zbv", 2, 4)) == [0.5] * 4


def test_an_unshard_issued_ahead_runs_beside_compute() -> None:
    plain = simulate(registry.build("zbv", 2, 4), ZERO3).makespan
    late, early = _zero3(2, 0), _zero3(2, 2)
    assert late.makespan == pytest.approx(plain + 0.5)  # 3F0 waits for 3UNSHARD, issued right before it
    assert early.makespan == pytest.approx(plain)  # 3UNSHARD runs beside 0F0 and 0F1
    # the step: the first all-gather (nothing to hide it behind), the computes, the last reduce-scatter
    assert summary(early)["step_time"] == pytest.approx(0.5 + plain + 0.5)


def test_first_gather_is_exposed_with_lookahead_on_one_stage_per_rank() -> None:
    plain = simulate(registry.build("1f1b", 2, 4), ZERO3).makespan
    out = _zero3(1, 3, "1f1b")
    assert out.makespan == pytest.approx(plain) and min(e.start for e in out.events) == 0.5
    assert summary(out)["step_time"] == pytest.approx(0.5 + plain + 0.5)


def test_memory_counts_shards_unsharded_stages_and_gradients() -> None:
    narrow, wide = summary(_zero3(1, 1)), summary(_zero3(2, 1))
    assert [r["peak_param_bytes"] for r in narrow["per_rank"]] == [150.0, 150.0]  # 2 shards of 25 + one stage
    assert [r["peak_param_bytes"] for r in wide["per_rank"]] == [250.0, 250.0]
    assert [r["all_gathers"] for r in narrow["per_rank"]] == [7, 13] and [r["all_gathers"] for r in
                                                                        wide["per_rank"]] == [2, 2]
    tl = _zero3(1, 1)
    last = tl.memory_curve(0)[-1]
    assert (last.params, last.grads) == (50.0, 50.0)  # shards only at the end of the step
    # windowed gradients: one stage's whole gradient beside the two 1/4 shards; a window of both holds both whole
    assert max(m.grads for m in tl.memory_curve(0)) == 150.0
    assert max(m.grads for m in _zero3(2, 1).memory_curve(0)) == 200.0
    plain = simulate(registry.build("zbv", 2, 4), ZERO3)
    assert plain.peak_memory(0) == (200.0, 200.0)  # no ZeRO-3 actions: whole parameters and gradients


def test_timeline_with_memory_round_trips() -> None:
    tl = _zero3(1, 1)
    assert Timeline.from_dict(tl.to_dict()) == tl
    assert simulate(registry.build("zbv", 2, 4)).memory == ()


@pytest.mark.parametrize("text,needle", [("dp=0", "cost dp must be an int >= 1"), ("dp=1.5", "whole number"),
                                         ("dp_bandwidth=0", "dp_bandwidth must be > 0"),
                                         ("param_bytes=-1", "param_bytes must be a finite number")])
def test_zero3_cost_keys(text: str, needle: str) -> None:
    assert CostModel.parse("param_bytes=4e6,dp=8,dp_bandwidth=1e9") == CostModel(param_bytes=4e6, dp=8,
                                                                                dp_bandwidth=1e9)
    with pytest.raises(ValueError, match=needle):
        CostModel.parse(text)


def test_hpz_gathers_after_the_first_inside_a_node_and_keeps_a_secondary_shard() -> None:
    """hpZ on 2-rank nodes: a stage's first all-gather of the step moves 75 bytes over the DP group (0.5 units),
    its later ones 50 bytes at the node's 500 per unit (0.1); between episodes it keeps 50 of its 100 bytes."""
    from dataclasses import replace

    from duplexpipe.schedules.shard import add_unshard_reshard

    hpz = replace(ZERO3, hpz_ranks=2, hpz_bandwidth=500.0)
    sharded = add_unshard_reshard(registry.build("zbv", 2, 4), 1, 1)
    plain, local = simulate(sharded, ZERO3), simulate(sharded, hpz)
    for tl in (plain, local):
        assert tl.memory_curve(0)[-1].params == 50.0  # at rest: 2 shards of 25
    seen: dict[int, int] = {}
    for span in (s for s in local.spans if s.lane == "fsdp" and s.rank == 0 and s.name.endswith("UNSHARD")):
        stage = int(span.name.removesuffix("UNSHARD"))
        assert span.end - span.start == pytest.approx(0.1 if seen.get(stage) else 0.5), span
        seen[stage] = seen.get(stage, 0) + 1
    assert sorted(seen.values()) == [3, 4]  # several episodes per stage: the later ones stay in the node
    assert local.makespan < plain.makespan  # the exposed re-gathers are cheaper
    # the shards (2 x 25) and the gathered stage (100); with hpZ the other stage's secondary shard too (50)
    assert max(m.params for m in plain.memory_curve(0)) == 150.0
    assert max(m.params for m in local.memory_curve(0)) == 200.0
    with pytest.raises(ValueError, match="hpz_ranks must be 0 .* divides dp=4 and is smaller, got 4"):
        CostModel.parse("dp=4,hpz_ranks=4")
    assert CostModel.parse("dp=4,hpz_ranks=2,hpz_bandwidth=1e9") == CostModel(dp=4, hpz_ranks=2, hpz_bandwidth=1e9)
