"""A scripted clock for the tests of the planner's measurements: no test depends on wall-clock speed."""

from __future__ import annotations


class ScriptedClock:
    """A timer for profile_parts, which reads the clock four times per run of a part (start, after F, after I,
    after W): each part's run takes the scripted (F, I, W) seconds, the parts in turn."""

    def __init__(self, costs: list[tuple[float, float, float]]) -> None:
        self.costs, self.reads, self.now = costs, 0, 0.0

    def __call__(self) -> float:
        part, read = divmod(self.reads, 4)
        if read:
            self.now += self.costs[part % len(self.costs)][read - 1]
        self.reads += 1
        return self.now
