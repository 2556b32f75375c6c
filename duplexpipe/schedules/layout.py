"""What every pass shares: the integer tables of a schedule's stage chains (who feeds whom, on which rank) and
the pause of the garbage collector they run under."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from duplexpipe.schedules.ir import Schedule


@dataclass(frozen=True)
class Layout:
    """Integer tables of one schedule's stage chains, and its tensor tokens.

    Token `s*M + m` is the forward input of stage s for microbatch m; token
    `S*M + s*M + m` the gradient of stage s's output (its backward input).
    """

    num_stages: int
    """S: how many stages."""
    num_microbatches: int
    """M: how many microbatches."""
    rank: tuple[int, ...]
    """rank[s]: the rank of stage s."""
    nxt: tuple[int, ...]
    """nxt[s]: the next stage in s's chain, or -1."""
    prv: tuple[int, ...]
    """prv[s]: the previous stage in s's chain, or -1."""
    lo: tuple[int, ...]
    """lo[s]: the first microbatch through stage s."""
    hi: tuple[int, ...]
    """hi[s]: one past the last microbatch through stage s."""

    @staticmethod
    def of(schedule: Schedule) -> Layout:
        """The layout of `schedule`'s stage table."""
        stages = range(schedule.num_stages)
        nxt = tuple(-1 if (n := schedule.next_stage(s)) is None else n for s in stages)
        prv = tuple(-1 if (p := schedule.prev_stage(s)) is None else p for s in stages)
        spans = [schedule.microbatches_of_stage(s) for s in stages]
        return Layout(schedule.num_stages, schedule.num_microbatches, tuple(i.rank for i in schedule.stages),
                      nxt, prv, tuple(r.start for r in spans), tuple(r.stop for r in spans))

    def feeds(self, stage: int, backward: bool) -> int:
        """The stage that receives `stage`'s forward output (backward: its input gradient), or -1."""
        return self.prv[stage] if backward else self.nxt[stage]

    def peer(self, stage: int, backward: bool) -> int:
        """The rank that `stage`'s output (backward: input gradient) goes to; -1 when it stays on
        `stage`'s rank (a local handoff) or goes nowhere (the end of a chain)."""
        other = self.feeds(stage, backward)
        return -1 if other < 0 or self.rank[other] == self.rank[stage] else self.rank[other]

    def rank_pairs(self) -> list[tuple[int, int]]:
        """Every pair of ranks (lower, higher) that exchange messages, sorted."""
        return sorted({(min(self.rank[s], self.rank[n]), max(self.rank[s], self.rank[n]))
                       for s, n in enumerate(self.nxt) if n >= 0 and self.rank[s] != self.rank[n]})

    @property
    def num_tokens(self) -> int:
        """How many tensor tokens exist (forward inputs and output gradients of every stage)."""
        return 2 * self.num_stages * self.num_microbatches

    def token_text(self, token: int, role: str) -> tuple[str, int]:
        """The action that `role` ("send", "recv" or "produce") does for `token`, and its rank."""
        half = self.num_stages * self.num_microbatches
        backward, rest = divmod(token, half)
        stage, mb = divmod(rest, self.num_microbatches)
        if role == "recv":
            return f"{stage}{'RECV_B' if backward else 'RECV_F'}{mb}", self.rank[stage]
        peer = self.nxt[stage] if backward else self.prv[stage]
        if role == "send":
            return f"{peer}{'SEND_B' if backward else 'SEND_F'}{mb}", self.rank[peer]
        return (f"{peer}B{mb} (or {peer}I{mb})" if backward else f"{peer}F{mb}"), self.rank[peer]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a pass allocates many acyclic objects.

    The passes build hundreds of thousands of tuples and Actions for large schedules; the
    collector's repeated scans of them cost more than the pass itself. The previous state
    is restored on exit, also on error.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
