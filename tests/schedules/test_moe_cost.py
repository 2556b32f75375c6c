"""The piece model of MoE stages: pieces of F and B, a pair interleaved at its exchanges (hand-timed), the cost
model's MoE keys, and the simulated "ep" lane."""

from __future__ import annotations

import pytest

from duplexpipe.schedules.ir import Op
from duplexpipe.schedules.moe_cost import (
    EP_LANE,
    ExpertCost,
    Piece,
    backward_pieces,
    forward_pieces,
    interleave,
    sequential_length,
)
from duplexpipe.schedules.registry import build
from duplexpipe.schedules.simulate import CostModel, simulate


def test_pieces_hold_the_compute_and_every_exchange() -> None:
    fwd = forward_pieces(5.0, 2, 0.5, 0.25)
    assert [p.compute for p in fwd] == [1.0] * 5 and [p.comm for p in fwd] == [0.5, 0.25, 0.5, 0.25, 0.0]
    bwd = backward_pieces(5.0, 2, 0.5, 0.25)
    assert [p.comm for p in bwd] == [0.25, 0.5, 0.25, 0.5, 0.0]
    assert [p.label for p in bwd][:2] == ["moe 1 combine backward", "moe 1 dispatch backward"]
    assert forward_pieces(3.0, 0, 1.0, 1.0) == [Piece(3.0, 0.0)]


def test_a_pair_interleaved_by_hand() -> None:
    # B: pieces 1,1,1 with combine-B then dispatch-B (1 each); F: pieces 1,1,1 with dispatch then combine.
    # B0 0-1 | combine-B 1-2; F0 1-2 | dispatch 2-3; B1 2-3 | dispatch-B 3-4; F1 3-4 | combine 4-5; B2 4-5; F2 5-6
    bwd, fwd = backward_pieces(3.0, 1, 1.0, 1.0), forward_pieces(3.0, 1, 1.0, 1.0)
    length, exchanges = interleave(bwd, fwd)
    assert length == 6.0 and sequential_length((bwd, fwd)) == 10.0
    assert [(p, s, e) for p, _, s, e in exchanges] == [(0, 1.0, 2.0), (1, 2.0, 3.0), (0, 3.0, 4.0), (1, 4.0, 5.0)]


def test_a_full_backwards_weight_gradients_fill_the_pairs_waits() -> None:
    # exchanges of 1.5, F pieces of 0.5. B pieces of 1 wait 0.5 before B1 and B2 and F2: 6.5. With W = 1.5
    # deferred, B pieces of 0.5 each leave 0.5: B0 0-0.5 | F0 -1 | fill -1.5, wait -2 | B1 -2.5 | F1 -3 |
    # fill -3.5, wait -4 | B2 -4.5 | F2 -5 | the last 0.5 of W: 5.5. Without overlap W changes nothing.
    ep = ExpertCost(1, 1.5, 1.5)
    assert ep.pair(1.5, 3.0) == pytest.approx(6.5) and ep.pair(1.5, 3.0, 1.5) == pytest.approx(5.5)
    assert ExpertCost(1, 1.5, 1.5, overlap=False).pair(1.5, 3.0, 1.5) == pytest.approx(10.5)
    pieces = backward_pieces(3.0, 1, 1.5, 1.5, deferred=1.5)
    assert [(p.compute, p.deferred) for p in pieces] == [(0.5, 0.5)] * 3


def test_without_exchanges_a_pair_is_its_two_parts() -> None:
    assert interleave([Piece(2.0, 0.0)], [Piece(1.0, 0.0)])[0] == 3.0
    assert ExpertCost().pair(1.0, 2.0) == 3.0
    assert ExpertCost(1, 0.5, 0.5, overlap=False).pair(1.0, 2.0) == pytest.approx(5.0)
    assert ExpertCost(1, 0.5, 0.5).pair(1.0, 2.0) < 5.0


def test_cost_model_keys_and_errors() -> None:
    cost = CostModel.parse("F=1,B=2,W=1,moe_layers=2,dispatch=0.25,combine=0.5,fb_overlap=false")
    assert (cost.moe_layers, cost.dispatch, cost.combine, cost.fb_overlap) == (2, 0.25, 0.5, False)
    assert cost.experts.per_pass == 1.5
    with pytest.raises(ValueError, match="moe_layers' needs a whole number >= 0, got '1.5'"):
        CostModel.parse("moe_layers=1.5")
    with pytest.raises(ValueError, match="moe_layers must be an int >= 0, got -1"):
        CostModel(moe_layers=-1)


def test_exchanges_lengthen_f_b_and_i_but_not_w() -> None:
    schedule = build("zb-h1", 2, 4)
    durations = CostModel(f=1, b=2, w=1, moe_layers=1, dispatch=0.5, combine=0.5).durations(schedule)
    assert (durations.f[0], durations.b[0], durations.i[0], durations.w[0]) == (2.0, 3.0, 2.0, 1.0)


def test_overlap_shortens_a_simulated_dualpipev_step_and_draws_the_ep_lane() -> None:
    schedule = build("dualpipev", 4, 8)
    base = {"moe_layers": 2, "dispatch": 0.25, "combine": 0.25, "stage_scale": True}
    on, off = simulate(schedule, CostModel(**base)), simulate(schedule, CostModel(**base, fb_overlap=False))
    assert on.makespan < off.makespan
    assert {s.lane for s in on.spans} == {EP_LANE}
    pairs = sum(1 for e in on.events if e.action.op is Op.OVERLAP_F_B)
    plain = sum(1 for e in on.events if e.action.op in (Op.F, Op.B, Op.I))
    assert len(on.spans) == 4 * (2 * pairs + plain)  # 2 layers x (dispatch, combine) per part
    for span in on.spans:  # every exchange lies inside a compute event of its rank
        assert any(e.rank == span.rank and e.start <= span.start and span.end <= e.end + 1e-9 for e in on.events)
    assert simulate(schedule, CostModel(stage_scale=True)).spans == ()
