"""Compile a schedule into per-rank instruction programs, checking its structure (`execute` runs them)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from duplexpipe.errors import ScheduleError
from duplexpipe.schedules.ir import NO_MICROBATCH, Action, Op, Schedule
from duplexpipe.schedules.layout import Layout, gc_paused

RECV, SEND, COMPUTE, SHARD = 0, 1, 2, 3
Instruction = tuple
"""(RECV, token) | (SEND, token) | (COMPUTE, action, inputs, outputs, duration)
| (SHARD, action, token, arrivals, lanes, duration).

`inputs` are the tokens a compute waits for, a message (cross-rank input of a lowered
schedule, needing its SEND and the local RECV) written as -1-token; `outputs` are the
tokens the compute makes available itself (local handoffs, or every output when the
schedule is not lowered). Tokens are defined by `Layout`.

A SHARD instruction is an UNSHARD, RESHARD or REDUCE_GRAD (`collectives` below). For a
collective, `token` (from `Layout.num_tokens` on) names the collective: `arrivals` actions
(one per member) join it, and it runs for `duration` on the data-parallel lane of each rank
in `lanes` once the last has joined, after what those lanes ran before; the first compute of
an UNSHARD's episode waits for its token. A RESHARD has token None (no communication).
"""
Program = list[list[Instruction]]


@dataclass(frozen=True)
class Durations:
    """Per-stage compute times for `analyze` (all zero when only checking)."""

    f: list[float]
    """f[s]: forward of stage s."""
    b: list[float]
    """b[s]: full backward of stage s."""
    i: list[float]
    """i[s]: input-gradient backward of stage s."""
    w: list[float]
    """w[s]: weight-gradient backward of stage s."""
    fb: list[float] | None = None
    """fb[s]: an F&B pair whose forward part is on stage s (with a full B; minus w for an I part);
    None: the sum of the parts."""
    unshard: list[float] | None = None
    """unshard[s]: the all-gather of stage s's parameters (UNSHARD); None: free."""
    reduce_grad: list[float] | None = None
    """reduce_grad[s]: the reduce-scatter of stage s's gradients (REDUCE_GRAD); None: free."""
    unshard_local: list[float] | None = None
    """unshard_local[s]: a later all-gather of stage s in the step, inside a node (hpZ); None: as unshard."""

    @staticmethod
    def zero(num_stages: int) -> Durations:
        """All times zero."""
        zeros = [0.0] * num_stages
        return Durations(zeros, zeros, zeros, zeros)


def analyze(schedule: Schedule, layout: Layout, durations: Durations | None = None) -> Program:
    """Checks (1) and (3) of `verify.verify` in one pass; returns the program that `execute.run_program` executes."""
    with gc_paused():
        state = _State(schedule, layout, durations or Durations.zero(layout.num_stages))
        program = [_analyze_rank(state, rank, row) for rank, row in enumerate(schedule.actions)]
    _check_complete(state)
    _check_matching(state)
    if state.has_fsdp:
        _link_collectives(state, program)
    return program


class _State:
    """Positions per (stage, microbatch) and per token, gathered while walking the lists once."""

    def __init__(self, schedule: Schedule, layout: Layout, durations: Durations) -> None:
        size, lowered = layout.num_stages * layout.num_microbatches, schedule.has_comms
        self.schedule, self.layout, self.lowered, self.durations = schedule, layout, lowered, durations
        self.f_at, self.bi_at, self.w_at = [-1] * size, [-1] * size, [-1] * size
        self.is_i = bytearray(size)
        self.send_at, self.recv_at = [-1] * (2 * size), [-1] * (2 * size)
        ranks = range(schedule.num_ranks)
        # one queue per pair of ranks that exchange messages (not per pair of ranks: that is quadratic in P)
        self.sends: list[defaultdict[int, list[int]]] = [defaultdict(list) for _ in ranks]
        """sends[a][b]: the tokens rank a sends to rank b, in posting order."""
        self.recvs: list[defaultdict[int, list[int]]] = [defaultdict(list) for _ in ranks]
        """recvs[b][a]: the tokens rank b receives from rank a, in posting order."""
        self.counts = [0, 0, 0, 0]  # F, B or I, I, W
        self.has_fsdp = False
        """True once an UNSHARD, RESHARD or REDUCE_GRAD was seen (then `_link_collectives` runs)."""
        rank, nmb = layout.rank, layout.num_microbatches

        def crosses(s: int, peer: int) -> bool:
            return peer >= 0 and lowered and rank[peer] != rank[s]
        # per stage: 0 no input, 1 local input, 2 message; output token base or -1 (sent by a SEND)
        stages = range(layout.num_stages)
        self.f_in = [0 if layout.prv[s] < 0 else 2 if crosses(s, layout.prv[s]) else 1 for s in stages]
        self.b_in = [0 if layout.nxt[s] < 0 else 2 if crosses(s, layout.nxt[s]) else 1 for s in stages]
        self.f_out = [-1 if layout.nxt[s] < 0 or crosses(s, layout.nxt[s]) else layout.nxt[s] * nmb
                      for s in stages]
        self.b_out = [-1 if layout.prv[s] < 0 or crosses(s, layout.prv[s]) else size + layout.prv[s] * nmb
                      for s in stages]
        # per stage: the peer rank of a SEND/RECV of each kind (-1: no such comm), and its token base
        to_next = [rank[layout.nxt[s]] if crosses(s, layout.nxt[s]) else -1 for s in stages]
        to_prev = [rank[layout.prv[s]] if crosses(s, layout.prv[s]) else -1 for s in stages]
        self.comm_tables = {
            Op.SEND_F: (to_next, [layout.nxt[s] * nmb for s in stages]),
            Op.SEND_B: (to_prev, [size + layout.prv[s] * nmb for s in stages]),
            Op.RECV_F: (to_prev, [s * nmb for s in stages]),
            Op.RECV_B: (to_next, [size + s * nmb for s in stages]),
        }

    def fail(self, rank: int, pos: int, action: Action, why: str) -> ScheduleError:
        """An error naming `action` and where it sits."""
        return ScheduleError(f"{self.schedule.name!r}: {action} at rank {rank}, position {pos}: {why}")

    def misplaced(self, rank: int, pos: int, action: Action) -> ScheduleError:
        """The error for an action whose stage, rank or microbatch is wrong."""
        lay, stage, mb = self.layout, action.stage, action.microbatch
        if stage >= lay.num_stages:
            return self.fail(rank, pos, action, f"unknown stage {stage} (stages are 0..{lay.num_stages - 1})")
        if lay.rank[stage] != rank:
            return self.fail(rank, pos, action, f"stage {stage} runs on rank {lay.rank[stage]}, not {rank}")
        return self.fail(rank, pos, action, f"microbatch {mb} is outside {lay.lo[stage]}..{lay.hi[stage] - 1}"
                         f" (the microbatches of stage {stage})")

    def compute(self, rank: int, pos: int, part: Action, inputs: list[int], outputs: list[int]) -> float:
        """Check one plain compute action (or pair part); add its tokens; return its duration."""
        lay, op, stage, mb = self.layout, part.op, part.stage, part.microbatch
        if stage >= lay.num_stages or lay.rank[stage] != rank or not lay.lo[stage] <= mb < lay.hi[stage]:
            raise self.misplaced(rank, pos, part)
        key, dur = stage * lay.num_microbatches + mb, self.durations
        if op is Op.W:
            self._weight(rank, pos, part, key)
            return dur.w[stage]
        forward = op is Op.F
        done = self.f_at if forward else self.bi_at
        if done[key] >= 0:
            raise self.fail(rank, pos, part, f"duplicate {'forward' if forward else 'backward'} "
                            f"(first at position {done[key]})")
        if not forward and not 0 <= self.f_at[key] < pos:
            raise self.fail(rank, pos, part, f"backward before its forward {stage}F{mb}"
                            " (the forward must come earlier on the same rank)")
        done[key] = pos
        self.counts[0 if forward else 1] += 1
        if op is Op.I:
            self.is_i[key] = 1
            self.counts[2] += 1
        kind = (self.f_in if forward else self.b_in)[stage]
        token = key if forward else lay.num_stages * lay.num_microbatches + key
        if kind == 2:
            if self.recv_at[token] < 0:
                raise self._unreceived(rank, pos, part, token)
            inputs.append(-1 - token)
        elif kind == 1:
            inputs.append(token)
        base = (self.f_out if forward else self.b_out)[stage]
        if base >= 0:
            outputs.append(base + mb)
        return dur.f[stage] if forward else dur.b[stage] if op is Op.B else dur.i[stage]

    def _weight(self, rank: int, pos: int, part: Action, key: int) -> None:
        if self.w_at[key] >= 0:
            raise self.fail(rank, pos, part, f"duplicate weight gradient (first at {self.w_at[key]})")
        if self.bi_at[key] < 0 or not self.is_i[key]:
            why = "after a full backward B (W only follows an I)" if self.bi_at[key] >= 0 else "before"
            raise self.fail(rank, pos, part, f"weight gradient {why} its input gradient "
                            f"{part.stage}I{part.microbatch}")
        self.w_at[key] = pos
        self.counts[3] += 1

    def _unreceived(self, rank: int, pos: int, part: Action, token: int) -> ScheduleError:
        recv, _ = self.layout.token_text(token, "recv")
        sender = self.layout.token_text(token, "send")[1]
        later = [i for i, a in enumerate(self.schedule.actions[rank]) if str(a) == recv]
        where = f"it is posted later, at position {later[0]}" if later else f"rank {rank} never posts it"
        return self.fail(rank, pos, part, f"consumes a tensor from rank {sender} without an earlier {recv} "
                         f"({where})")

    def plain(self, rank: int, pos: int, action: Action) -> Instruction:
        """Check a plain compute action (F, B, I or W), or place an UNSHARD, RESHARD or REDUCE_GRAD (checked and
        linked by `_link_collectives`)."""
        if action.op.is_fsdp:
            lay = self.layout
            if action.stage >= lay.num_stages or lay.rank[action.stage] != rank:
                raise self.misplaced(rank, pos, action)
            if action.microbatch != NO_MICROBATCH:
                raise self.fail(rank, pos, action, f"{action.op.value} acts on a whole stage: its microbatch must "
                                "be NO_MICROBATCH (Action.on_stage)")
            self.has_fsdp = True
            return (SHARD, action, None, 0, (), 0.0)
        inputs: list[int] = []
        outputs: list[int] = []
        cost = self.compute(rank, pos, action, inputs, outputs)
        return (COMPUTE, action, tuple(inputs), tuple(outputs), cost)

    def pair(self, rank: int, pos: int, action: Action) -> Instruction:
        """Check an OVERLAP_F_B pair (its B part may not consume the pair's own F)."""
        inputs: list[int] = []
        outputs: list[int] = []
        back, fwd = action.parts[1], action.parts[0]
        cost = self.compute(rank, pos, back, inputs, outputs) + self.compute(rank, pos, fwd, inputs, outputs)
        fb = self.durations.fb
        if fb is not None:
            cost = fb[fwd.stage] - (self.durations.w[back.stage] if back.op is Op.I else 0.0)
        return (COMPUTE, action, tuple(inputs), tuple(outputs), cost)

    def comm_error(self, rank: int, pos: int, action: Action) -> ScheduleError:
        """The error for a SEND/RECV that `_analyze_rank` rejected."""
        lay, op, stage, mb = self.layout, action.op, action.stage, action.microbatch
        if stage >= lay.num_stages or lay.rank[stage] != rank or not lay.lo[stage] <= mb < lay.hi[stage]:
            return self.misplaced(rank, pos, action)
        forward, sending = op in (Op.SEND_F, Op.RECV_F), op in (Op.SEND_F, Op.SEND_B)
        peer = lay.nxt[stage] if forward == sending else lay.prv[stage]
        if peer < 0:
            end = "last" if forward == sending else "first"
            return self.fail(rank, pos, action, f"stage {stage} is the {end} stage of its chain: there is no "
                             "peer stage")
        if lay.rank[peer] == rank:
            return self.fail(rank, pos, action, f"stages {stage} and {peer} both run on rank {rank}: "
                             "they hand over locally, without SEND/RECV")
        key = stage * lay.num_microbatches + mb
        if sending and (self.f_at if forward else self.bi_at)[key] < 0:
            producer = f"{stage}F{mb}" if forward else f"{stage}B{mb} (or {stage}I{mb})"
            return self.fail(rank, pos, action, f"sent before its producer {producer} (it must come earlier "
                             f"on rank {rank})")
        half = lay.num_stages * lay.num_microbatches
        token = (0 if forward else half) + (peer if sending else stage) * lay.num_microbatches + mb
        first = (self.send_at if sending else self.recv_at)[token]
        return self.fail(rank, pos, action, f"duplicate (first at position {first})")


def _analyze_rank(state: _State, rank: int, row: tuple[Action, ...]) -> list[Instruction]:
    """Check one rank's list and compile it.

    SEND/RECV (most actions of a lowered schedule) are checked inline, plain F and B and
    F&B pairs by `_fast_plain`/`_fast_pair`; anything else, and anything those do not
    accept, goes through `_State.plain`/`pair`/`comm_error`, which hold the rules and
    raise the precise error.
    """
    lay = state.layout
    nmb, nstages, rank_of, lo, hi = lay.num_microbatches, lay.num_stages, lay.rank, lay.lo, lay.hi
    f_at, bi_at, recv_at = state.f_at, state.bi_at, state.recv_at
    Spec = tuple[list[int], list[int], "list[int] | None", defaultdict[int, list[int]], list[int], int]
    tables = state.comm_tables
    specs: tuple[Spec, ...] = (
        (*tables[Op.SEND_F], f_at, state.sends[rank], state.send_at, SEND),
        (*tables[Op.SEND_B], bi_at, state.sends[rank], state.send_at, SEND),
        (*tables[Op.RECV_F], None, state.recvs[rank], recv_at, RECV),
        (*tables[Op.RECV_B], None, state.recvs[rank], recv_at, RECV))
    send_f, send_b, recv_f, recv_b, overlap = Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B, Op.OVERLAP_F_B
    out: list[Instruction] = []
    counted = [0, 0]
    fast = (nmb, nstages, rank_of, lo, hi, f_at, bi_at, recv_at, state.f_in, state.b_in, state.f_out,
            state.b_out, state.durations, counted)
    for pos, action in enumerate(row):
        op, stage, mb = action.op, action.stage, action.microbatch
        if op is send_f:
            peers, bases, made, queues, seen, kind = specs[0]
        elif op is send_b:
            peers, bases, made, queues, seen, kind = specs[1]
        elif op is recv_f:
            peers, bases, made, queues, seen, kind = specs[2]
        elif op is recv_b:
            peers, bases, made, queues, seen, kind = specs[3]
        elif op is overlap:
            out.append(_fast_pair(fast, rank, pos, action) or state.pair(rank, pos, action))
            continue
        else:
            out.append(_fast_plain(fast, rank, pos, action) or state.plain(rank, pos, action))
            continue
        if stage >= nstages or rank_of[stage] != rank or not lo[stage] <= mb < hi[stage]:
            raise state.comm_error(rank, pos, action)
        peer = peers[stage]
        if peer < 0 or (made is not None and made[stage * nmb + mb] < 0):
            raise state.comm_error(rank, pos, action)
        token = bases[stage] + mb
        if seen[token] >= 0:
            raise state.comm_error(rank, pos, action)
        seen[token] = pos
        queues[peer].append(token)
        out.append((kind, token))
    state.counts[0] += counted[0]
    state.counts[1] += counted[1]
    return out


def _fast_plain(fast: tuple, rank: int, pos: int, action: Action) -> Instruction | None:
    """A plain F or B that passes every check, compiled; else None (use `_State.plain`)."""
    nmb, nstages, rank_of, lo, hi, f_at, bi_at, recv_at, f_in, b_in, f_out, b_out, dur, counted = fast
    op, stage, mb = action.op, action.stage, action.microbatch
    forward = op is Op.F
    if (not (forward or op is Op.B) or stage >= nstages or rank_of[stage] != rank
            or not lo[stage] <= mb < hi[stage]):
        return None
    key = stage * nmb + mb
    if (f_at[key] >= 0) if forward else (bi_at[key] >= 0 or not 0 <= f_at[key] < pos):
        return None
    kind, token = (f_in[stage], key) if forward else (b_in[stage], nstages * nmb + key)
    if kind == 2 and recv_at[token] < 0:
        return None
    (f_at if forward else bi_at)[key] = pos
    counted[not forward] += 1
    base = (f_out if forward else b_out)[stage]
    inputs = () if kind == 0 else (token,) if kind == 1 else (-1 - token,)
    return (COMPUTE, action, inputs, () if base < 0 else (base + mb,), (dur.f if forward else dur.b)[stage])


def _fast_pair(fast: tuple, rank: int, pos: int, action: Action) -> Instruction | None:
    """An F&B pair with a full B whose parts pass every check, compiled; else None (use `_State.pair`)."""
    nmb, nstages, rank_of, lo, hi, f_at, bi_at, recv_at, f_in, b_in, f_out, b_out, dur, counted = fast
    fwd, back = action.parts
    fs, fm, bs, bm = fwd.stage, fwd.microbatch, back.stage, back.microbatch
    if (back.op is not Op.B or fs >= nstages or bs >= nstages or rank_of[fs] != rank or rank_of[bs] != rank
            or not lo[fs] <= fm < hi[fs] or not lo[bs] <= bm < hi[bs]):
        return None
    fkey, bkey, half = fs * nmb + fm, bs * nmb + bm, nstages * nmb
    fkind, bkind = f_in[fs], b_in[bs]
    if (f_at[fkey] >= 0 or bi_at[bkey] >= 0 or not 0 <= f_at[bkey] < pos
            or fkind == 2 and recv_at[fkey] < 0 or bkind == 2 and recv_at[half + bkey] < 0):
        return None
    f_at[fkey], bi_at[bkey] = pos, pos
    counted[0] += 1
    counted[1] += 1
    inputs = [bkey + half if bkind == 1 else -1 - half - bkey] if bkind else []
    if fkind:
        inputs.append(fkey if fkind == 1 else -1 - fkey)
    outputs = [b_out[bs] + bm] if b_out[bs] >= 0 else []
    if f_out[fs] >= 0:
        outputs.append(f_out[fs] + fm)
    cost = dur.f[fs] + dur.b[bs] if dur.fb is None else dur.fb[fs]
    return (COMPUTE, action, tuple(inputs), tuple(outputs), cost)


def _check_complete(state: _State) -> None:
    lay, name = state.layout, state.schedule.name
    expected = sum(lay.hi[s] - lay.lo[s] for s in range(lay.num_stages))
    f, bi, i, w = state.counts
    if f == expected and bi == expected and w == i:
        return
    missing: list[str] = []
    for s in range(lay.num_stages):
        for m in range(lay.lo[s], lay.hi[s]):
            key, on = s * lay.num_microbatches + m, f" on rank {lay.rank[s]}"
            if state.f_at[key] < 0:
                missing.append(f"{s}F{m}{on}")
            if state.bi_at[key] < 0:
                missing.append(f"{s}B{m} (or {s}I{m} and {s}W{m}){on}")
            elif state.is_i[key] and state.w_at[key] < 0:
                missing.append(f"{s}W{m}{on}")
    shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
    raise ScheduleError(f"{name!r} is incomplete: missing {shown}")


def _check_matching(state: _State) -> None:
    lay, name = state.layout, state.schedule.name
    pairs = {(a, b) for a, peers in enumerate(state.sends) for b in peers}
    pairs.update((a, b) for b, peers in enumerate(state.recvs) for a in peers)
    for src, dst in sorted(pairs):
        sent, received = state.sends[src].get(dst, []), state.recvs[dst].get(src, [])
        if sent == received:
            continue
        in_recv, in_sent = set(received), set(sent)
        for k in range(max(len(sent), len(received))):
            s = sent[k] if k < len(sent) else None
            r = received[k] if k < len(received) else None
            if s == r:
                continue
            if s is not None and s not in in_recv:
                raise ScheduleError(f"{name!r}: {lay.token_text(s, 'send')[0]} on rank {src} has no matching "
                                    f"{lay.token_text(s, 'recv')[0]} on rank {dst} (missing receive)")
            if r is not None and r not in in_sent:
                raise ScheduleError(f"{name!r}: {lay.token_text(r, 'recv')[0]} on rank {dst} has no matching "
                                    f"{lay.token_text(r, 'send')[0]} on rank {src} (missing send)")
            assert s is not None and r is not None
            raise ScheduleError(
                f"{name!r}: rank {dst} receives from rank {src} out of order: message {k} is "
                f"{lay.token_text(s, 'send')[0]} (the sender's order) but rank {dst} posts "
                f"{lay.token_text(r, 'recv')[0]} there; receives must follow the sender's posting order")


def _link_collectives(state: _State, program: Program) -> None:
    """Check the ZeRO-3 actions of every rank and give each collective its token, members and duration.

    Rules (each error names the action and where it sits): when any rank has UNSHARD or RESHARD, every compute runs
    inside an episode of each stage it needs (an UNSHARD before it, no RESHARD between); an UNSHARD of a stage
    already unsharded, a RESHARD of one that is not, an episode without compute or one still open at the end of
    the list is refused. When any rank has REDUCE_GRAD, every stage has one after all of its B and W (one per
    microbatch through it); a stage may have several (a reshard window smaller than its rank's stages reduces after
    each episode), each after a B or W since the one before, none of those after the last; a weight group with
    copies on several ranks has one per copy, after all of its gradients. An UNSHARD joins its rank's
    data-parallel group alone; a REDUCE_GRAD joins the REDUCE_GRADs of every copy of its weight group (DualPipe's
    two copies sum their gradients: one collective over both ranks), matched by weight group and order of issue.
    """
    lay, schedule = state.layout, state.schedule
    episodic = any(a.op is Op.UNSHARD or a.op is Op.RESHARD for row in schedule.actions for a in row)
    reducing = any(a.op is Op.REDUCE_GRAD for row in schedule.actions for a in row)
    copies: dict[int, list[int]] = {}
    for stage, info in enumerate(schedule.stages):
        copies.setdefault(info.group, []).append(stage)
    unshard, reduce, local = state.durations.unshard, state.durations.reduce_grad, state.durations.unshard_local
    tokens: dict[tuple[int, int, int], int] = {}
    reduced = [-1] * lay.num_stages
    issued = [0] * lay.num_stages  # REDUCE_GRADs of each stage so far
    for rank, row in enumerate(program):
        live: dict[int, int] = {}  # stage -> position of its UNSHARD, until its episode's first compute
        open_at: dict[int, int] = {}  # stage -> position of its open episode's UNSHARD
        grads = [0] * lay.num_stages
        since: dict[int, tuple[int, Action]] = {}  # stage -> its last B or W since its last REDUCE_GRAD
        joined: dict[int, int] = {}
        for pos, ins in enumerate(row):
            if ins[0] == COMPUTE:
                _episode_compute(state, rank, pos, ins, live, open_at, episodic, grads, since, row)
            elif ins[0] == SHARD:
                action = ins[1]
                stage, op = action.stage, action.op
                if op is Op.UNSHARD:
                    if stage in open_at:
                        raise state.fail(rank, pos, action, f"stage {stage} is already unsharded (by the UNSHARD "
                                         f"at position {open_at[stage]}, with no RESHARD since)")
                    open_at[stage] = live[stage] = pos
                    key = (0, rank * lay.num_stages + stage, joined.get(stage, 0))
                    joined[stage] = key[2] + 1
                    gather = local if key[2] and local is not None else unshard  # hpZ: later ones in a node
                    cost = gather[stage] if gather is not None else 0.0
                    row[pos] = (SHARD, action, tokens.setdefault(key, lay.num_tokens + len(tokens)), 1, (rank,),
                                cost)
                elif op is Op.RESHARD:
                    if stage not in open_at:
                        raise state.fail(rank, pos, action, f"stage {stage} is not unsharded here (no UNSHARD "
                                         "since its last RESHARD)")
                    if stage in live:
                        raise state.fail(rank, pos, action, f"the episode from {stage}UNSHARD at position "
                                         f"{open_at[stage]} has no compute of stage {stage}")
                    del open_at[stage]
                else:
                    row[pos] = _reduce_grad(state, rank, pos, action, (grads, since, reduced, issued), copies,
                                            tokens, reduce)
        late = [(at, part) for stage, (at, part) in since.items() if reduced[stage] >= 0]
        if late:
            at, part = min(late, key=lambda x: x[0])
            raise state.fail(rank, at, part, f"a gradient of stage {part.stage} after its last REDUCE_GRAD (at "
                             f"position {reduced[part.stage]})")
        if open_at:
            stage = min(open_at)
            raise state.fail(rank, open_at[stage], Action.on_stage(stage, Op.UNSHARD),
                             f"stage {stage} is still unsharded at the end of rank {rank}'s list (add "
                             f"{stage}RESHARD after its last compute)")
    if reducing and min(reduced) < 0:
        missing = [f"{s}REDUCE_GRAD on rank {lay.rank[s]}" for s, at in enumerate(reduced) if at < 0]
        raise _missing_reduce(schedule.name, missing)


def _missing_reduce(name: str, missing: list[str]) -> ScheduleError:
    """The error for stages without a REDUCE_GRAD in a schedule that has some."""
    shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
    return ScheduleError(f"{name!r} is incomplete: missing {shown} (every stage reduces its gradients once per "
                         "step when any does)")


def _episode_compute(state: _State, rank: int, pos: int, ins: Instruction, live: dict[int, int],
                     open_at: dict[int, int], episodic: bool, grads: list[int], since: dict[int, tuple[int, Action]],
                     row: list[Instruction]) -> None:
    """Check one compute against the open episodes; make the first compute of an episode wait for its UNSHARD."""
    waits: list[int] = []
    for part in ins[1].compute_parts():
        stage = part.stage
        if episodic and stage not in open_at:
            raise state.fail(rank, pos, part, f"stage {stage} is sharded here (no {stage}UNSHARD before it since "
                             "its last RESHARD)")
        if stage in live:
            waits.append(row[live.pop(stage)][2])
        if part.op is Op.B or part.op is Op.W:
            grads[stage] += 1
            since[stage] = (pos, part)
    if waits:
        row[pos] = (COMPUTE, ins[1], ins[2] + tuple(waits), ins[3], ins[4])


def _reduce_grad(state: _State, rank: int, pos: int, action: Action,
                 counts: tuple[list[int], dict[int, tuple[int, Action]], list[int], list[int]],
                 copies: dict[int, list[int]], tokens: dict[tuple[int, int, int], int],
                 cost: list[float] | None) -> Instruction:
    """Check one REDUCE_GRAD (`counts`: B or W run per stage, the last since its REDUCE_GRAD, the position of that,
    the REDUCE_GRADs issued so far) and compile it as the collective of its weight group (the k-th of a stage
    matched with the k-th of its copies)."""
    lay, stage = state.layout, action.stage
    grads, since, reduced, issued = counts
    group = state.schedule.stages[stage].group
    members = copies[group]
    through = lay.hi[stage] - lay.lo[stage]
    if reduced[stage] >= 0 and (stage not in since or len(members) > 1):
        raise state.fail(rank, pos, action, f"duplicate (no B or W of stage {stage} since the one at position "
                         f"{reduced[stage]})")
    if stage not in since or (len(members) > 1 and grads[stage] < through):
        raise state.fail(rank, pos, action, f"before the last gradient of stage {stage}: {grads[stage]} of its "
                         f"{through} B or W ran before it")
    since.pop(stage)
    reduced[stage] = pos
    lanes = tuple(sorted({lay.rank[s] for s in members}))
    token = tokens.setdefault((1, group, issued[stage]), lay.num_tokens + len(tokens))
    issued[stage] += 1
    return (SHARD, action, token, len(members), lanes, cost[stage] if cost is not None else 0.0)
