"""A scripted clock for the tests of the planner's measurements: no test depends on wall-clock speed."""

from __future__ import annotations


class _Scripted:
    """A clock that stands still except at the reads `advance` names, where it moves by the seconds it returns."""

    def __init__(self) -> None:
        self.reads, self.now = 0, 0.0

    def advance(self, read: int) -> float:
        raise NotImplementedError

    def __call__(self) -> float:
        self.now += self.advance(self.reads)
        self.reads += 1
        return self.now


class ScriptedClock(_Scripted):
    """A timer for profile_parts, which reads the clock four times per run of a part (start, after F, after I,
    after W): each part's run takes the scripted (F, I, W) seconds, the parts in turn."""

    def __init__(self, costs: list[tuple[float, float, float]]) -> None:
        super().__init__()
        self.costs = costs

    def advance(self, read: int) -> float:
        part, at = divmod(read, 4)
        return self.costs[part % len(self.costs)][at - 1] if at else 0.0
