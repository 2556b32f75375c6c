"""Argument checks and stage tables shared by the schedule generators."""

from __future__ import annotations

from collections import deque

from duplexpipe.schedules.ir import Action, Op, StageInfo


def require_int(name: str, what: str, value: object, minimum: int) -> int:
    """Return `value` if it is an int >= `minimum`, else raise ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} needs an integer {what}, got {what}={value!r}")  # noqa: TRY004 - bad input
    if value < minimum:
        raise ValueError(f"{name} needs {what} >= {minimum}, got {what}={value}")
    return value


def require_counts(name: str, num_ranks: object, num_microbatches: object, min_ranks: int = 1) -> None:
    """Check the two counts every generator takes (integers, ranks >= min_ranks, microbatches >= 1)."""
    require_int(name, "num_ranks", num_ranks, min_ranks)
    require_int(name, "num_microbatches", num_microbatches, 1)


def linear_stages(num_ranks: int) -> tuple[StageInfo, ...]:
    """One stage per rank: stage s on rank s (GPipe, 1F1B, ZB-H1)."""
    return tuple(StageInfo(rank=s, group=s) for s in range(num_ranks))


def looped_stages(num_ranks: int, chunks: int) -> tuple[StageInfo, ...]:
    """Interleaved placement: num_ranks * chunks stages, stage s on rank s mod num_ranks."""
    return tuple(StageInfo(rank=s % num_ranks, group=s) for s in range(num_ranks * chunks))


def v_rank(num_ranks: int, stage: int) -> int:
    """The rank of `stage` in the V shape: s for s < P, 2P-1-s otherwise."""
    return stage if stage < num_ranks else 2 * num_ranks - 1 - stage


def v_stages(num_ranks: int) -> tuple[StageInfo, ...]:
    """V-shape placement (ZB-V, DualPipeV): 2P stages in one chain, folded back at rank P-1."""
    return tuple(StageInfo(rank=v_rank(num_ranks, s), group=s) for s in range(2 * num_ranks))


def dual_stages(num_ranks: int) -> tuple[StageInfo, ...]:
    """DualPipe placement: stages 0..P-1 downward (s on rank s); stage P+k is part k on rank P-1-k."""
    down = [StageInfo(rank=s, group=s) for s in range(num_ranks)]
    up = [StageInfo(rank=num_ranks - 1 - k, group=k) for k in range(num_ranks)]
    return tuple(down + up)


class RowBuilder:
    """Builds one rank's action list; each stage takes its microbatches in a fixed order.

    Split backwards (I) queue their weight gradient; `weight()` emits the oldest queued W.
    """

    def __init__(self, order: dict[int, range]) -> None:
        self.actions: list[Action] = []
        self._order = order
        self._taken: dict[tuple[int, Op], int] = {}
        self._deferred: deque[tuple[int, int]] = deque()

    def _take(self, stage: int, kind: Op) -> int:
        index = self._taken.get((stage, kind), 0)
        self._taken[(stage, kind)] = index + 1
        return self._order[stage][index]

    def forwards_done(self, stage: int) -> int:
        """How many forwards of `stage` this list holds so far."""
        return self._taken.get((stage, Op.F), 0)

    def make_forward(self, stage: int) -> Action:
        """The next forward of `stage` (not appended)."""
        return Action(stage, Op.F, self._take(stage, Op.F))

    def make_backward(self, stage: int, split: bool = False) -> Action:
        """The next backward of `stage`: I with its W queued when `split`, else a full B (not appended)."""
        microbatch = self._take(stage, Op.B)
        if split:
            self._deferred.append((stage, microbatch))
            return Action(stage, Op.I, microbatch)
        return Action(stage, Op.B, microbatch)

    def forward(self, stage: int) -> None:
        """Append the next forward of `stage`."""
        self.actions.append(self.make_forward(stage))

    def backward(self, stage: int, split: bool = False) -> None:
        """Append the next backward of `stage` (I when `split`, else B)."""
        self.actions.append(self.make_backward(stage, split))

    def overlap(self, forward_stage: int, backward_stage: int) -> None:
        """Append the pair (next forward of one stage; next full backward of another)."""
        pair = Action.overlap(self.make_forward(forward_stage), self.make_backward(backward_stage))
        self.actions.append(pair)

    def weight(self, stage: int | None = None) -> None:
        """Append the W of the oldest queued split backward (of `stage`, if given)."""
        for i, (s, microbatch) in enumerate(self._deferred):
            if stage is None or s == stage:
                del self._deferred[i]
                self.actions.append(Action(s, Op.W, microbatch))
                return
        raise RuntimeError(f"no deferred weight gradient{'' if stage is None else f' of stage {stage}'} left")

    def flush_weights(self, stage: int | None = None) -> None:
        """Append every queued W (of `stage`, if given), oldest first."""
        for s, microbatch in [d for d in self._deferred if stage is None or d[0] == stage]:
            self._deferred.remove((s, microbatch))
            self.actions.append(Action(s, Op.W, microbatch))

    def finish(self) -> tuple[Action, ...]:
        """The finished list; raises RuntimeError if a weight gradient was never emitted."""
        if self._deferred:
            raise RuntimeError(f"weight gradients never emitted: {list(self._deferred)}")
        return tuple(self.actions)
