"""The piece model of stages with expert-parallel all-to-alls: where each exchange sits inside F, B and an
F&B pair, how long a pair takes with and without overlap, and the "ep" lane of a simulated timeline.

A stage with L MoE layers runs its forward as 2L+1 equal compute pieces with an exchange after each of the
first 2L (per layer: dispatch after the attention/router piece, combine after the experts), and its backward
the same way in reverse (combine-B, then dispatch-B, per layer). The exchanges of one part are issued in
order; in an overlapped pair the two parts alternate at their exchanges (the runtime's `run_pair`): an
exchange runs while the other part computes, and a part waits for its exchange before its next piece. A full
backward in an overlapped pair leaves its weight gradients (W, spread evenly over its pieces) to fill the
pair's waits, as the runtime forms the deferred weight gradients (`moe.linear`); what is left runs after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from duplexpipe.schedules.ir import Action, Op
from duplexpipe.schedules.timeline import Event, Span

EP_LANE = "ep"
"""The lane of expert-parallel exchanges in a timeline (measured and simulated)."""


@dataclass(frozen=True)
class Piece:
    """One compute piece of a part, and the exchange issued after it (0: none)."""

    compute: float
    comm: float
    label: str = ""
    deferred: float = 0.0
    """Weight-gradient work this piece leaves for the pair's waits (a full backward in an overlapped pair)."""


def forward_pieces(f: float, layers: int, dispatch: float, combine: float) -> list[Piece]:
    """F as pieces: per layer (attention + router + permute, dispatch), (experts, combine); then the rest."""
    if layers <= 0:
        return [Piece(f, 0.0)]
    share = f / (2 * layers + 1)
    out = []
    for j in range(layers):
        out += [Piece(share, dispatch, f"moe {j} dispatch"), Piece(share, combine, f"moe {j} combine")]
    return out + [Piece(share, 0.0)]


def backward_pieces(b: float, layers: int, dispatch: float, combine: float, deferred: float = 0.0) -> list[Piece]:
    """B (or I) as pieces: per layer from the last, (the rest above it, combine-B), (experts, dispatch-B).
    `deferred` of b (weight gradients, in a pair) is left by the pieces, evenly, to fill waits."""
    if layers <= 0:
        return [Piece(b, 0.0)]
    share, left = (b - deferred) / (2 * layers + 1), deferred / (2 * layers + 1)
    out = []
    for j in reversed(range(layers)):
        out += [Piece(share, combine, f"moe {j} combine backward", left),
                Piece(share, dispatch, f"moe {j} dispatch backward", left)]
    return out + [Piece(share, 0.0, "", left)]


def sequential_length(parts: Sequence[Sequence[Piece]]) -> float:
    """Parts run one after the other, every exchange waited for where it is issued."""
    return sum(p.compute + p.comm for part in parts for p in part)


def interleave(first: Sequence[Piece], second: Sequence[Piece]) -> tuple[float, list[tuple[int, str, float, float]]]:
    """The overlapped pair: (its length, [(part, label, exchange start, exchange end)]) with part 0 = `first`.
    The parts alternate as `runtime.fb_pair.run_pair` runs them; exchanges of both parts may be in flight. While
    a due part waits for its exchange, work the pieces so far deferred fills the wait; the rest runs at the
    end."""
    parts = (list(first), list(second))
    at, ready, now, pool = [0, 0], [0.0, 0.0], 0.0, 0.0
    exchanges: list[tuple[int, str, float, float]] = []
    turn = 0
    while at[0] < len(parts[0]) or at[1] < len(parts[1]):
        if at[turn] < len(parts[turn]):
            piece = parts[turn][at[turn]]
            fill = min(pool, max(0.0, ready[turn] - now))
            now, pool = now + fill, pool - fill
            now = max(now, ready[turn]) + piece.compute
            pool += piece.deferred
            ready[turn] = now + piece.comm
            if piece.comm:
                exchanges.append((turn, piece.label, now, now + piece.comm))
            at[turn] += 1
        turn = 1 - turn
    return max(now, *ready) + pool, exchanges


@dataclass(frozen=True)
class ExpertCost:
    """The expert-parallel exchanges of every stage: `layers` MoE layers per stage, each forward with one
    dispatch and one combine all-to-all (the backward with one of each too), in the cost model's unit."""

    layers: int = 0
    dispatch: float = 0.0
    combine: float = 0.0
    overlap: bool = True
    """F&B pairs run interleaved at their exchanges (PipelineConfig.fb_overlap)."""

    @property
    def per_pass(self) -> float:
        """The exchange time inside one F (or one B / I)."""
        return self.layers * (self.dispatch + self.combine)

    def pair(self, f: float, b: float, w: float = 0.0) -> float:
        """An F&B pair's length with a full B part (its exchanges included; interleaved when `overlap`, with the
        B's weight gradients w filling the waits)."""
        parts = self._pair_parts(f, b, w)
        return interleave(*parts)[0] if self.overlap and self.layers else sequential_length(parts)

    def _pair_parts(self, f: float, b: float, w: float) -> tuple[list[Piece], list[Piece]]:
        """A pair's (backward, forward) pieces; the backward defers w only when the pair is interleaved."""
        return (backward_pieces(b, self.layers, self.dispatch, self.combine, w if self.overlap else 0.0),
                forward_pieces(f, self.layers, self.dispatch, self.combine))

    def spans(self, event: Event, f: float, b: float, w: float = 0.0) -> list[Span]:
        """The "ep" lane spans of one compute event (F, B, I or a pair) whose compute times are f and b (w: the
        weight gradients a full B defers, inside a pair only)."""
        action = event.action
        if action.op is Op.OVERLAP_F_B:
            fwd, bwd = action.parts
            parts = self._pair_parts(f, b, w)
            if self.overlap:
                _, found = interleave(*parts)
                return [Span(event.rank, EP_LANE, _name(bwd if p == 0 else fwd, label), event.start + s,
                             event.start + e) for p, label, s, e in found]
            return _in_order(event, [(bwd, parts[0]), (fwd, parts[1])])
        if action.op is Op.F:
            return _in_order(event, [(action, forward_pieces(f, self.layers, self.dispatch, self.combine))])
        if action.op in (Op.B, Op.I):
            return _in_order(event, [(action, backward_pieces(b, self.layers, self.dispatch, self.combine))])
        return []


def _name(action: Action, label: str) -> str:
    return f"{action.stage}{action.op.value}{action.microbatch} {label}"


def _in_order(event: Event, parts: list[tuple[Action, list[Piece]]]) -> list[Span]:
    out, now = [], event.start
    for action, pieces in parts:
        for piece in pieces:
            now += piece.compute
            if piece.comm:
                out.append(Span(event.rank, EP_LANE, _name(action, piece.label), now, now + piece.comm))
                now += piece.comm
    return out
