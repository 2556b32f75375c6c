"""The schedule IR: Op, Action, the stage table and Schedule, with text and JSON forms."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any, Iterable, Iterator, Sequence

from duplexpipe.errors import ScheduleError
from duplexpipe.files import read_capped_text, require_regular

JSON_FORMAT = "duplexpipe-schedule"
JSON_VERSION = 1
MAX_SCHEDULE_FILE_BYTES = 128 * 2**20
"""Largest schedule file read (128 MiB), refused before it is parsed. The largest schedule the command line builds
(P x M = 500,000) takes at most about 110 MB as lowered JSON (ZB-V, 212 bytes per P x M unit) and about 22 s to
load; a file of 200 MB is refused at once."""
MAX_ACTIONS_PER_UNIT = 15
"""Most actions one (stage, microbatch) has in a lowered schedule with ZeRO-3 actions: F, B, I, W, SEND_F, RECV_F,
SEND_B, RECV_B (an F&B pair is one action of two), an UNSHARD and a RESHARD around each of its three computes at the
narrowest window, and the REDUCE_GRAD after the episode of its B or W (windowed gradients); one REDUCE_GRAD per
stage comes on top (`MAX_ACTIONS_PER_STAGE`)."""
MAX_ACTIONS_PER_STAGE = 1
"""Actions per stage on top of `MAX_ACTIONS_PER_UNIT` per (stage, microbatch): its REDUCE_GRAD."""
NO_MICROBATCH = -1
"""The `microbatch` of an action on a whole stage (UNSHARD, RESHARD, REDUCE_GRAD); torch's `_Action` holds None there
and its text form omits it, as ours does."""
_HEADER_BYTES = 64 * 1024
_HEADER_FIELD = re.compile(r'"(num_ranks|num_microbatches)"\s*:\s*(-?\d+)')


class Op(str, Enum):
    """One instruction kind; the value is its text form in torch.distributed.pipelining."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the name torch uses for input-gradient backward
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OVERLAP_F_B = "OVERLAP_F_B"
    UNSHARD = "UNSHARD"
    """All-gather a stage's sharded parameters (ZeRO-3 / FSDP2), issued ahead of the stage's compute."""
    RESHARD = "RESHARD"
    """Free a stage's unsharded parameters (no communication)."""
    REDUCE_GRAD = "REDUCE_GRAD"
    """Reduce-scatter a stage's gradients over data parallelism: once per step after its last B or W, or (a reshard
    window smaller than the rank's stages) after each residency episode with a B or W, adding into its shard."""

    @property
    def is_compute(self) -> bool:
        """True for F, B, I, W and OVERLAP_F_B."""
        return self in COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        """True for the four send/receive ops."""
        return self in COMM_OPS

    @property
    def is_fsdp(self) -> bool:
        """True for UNSHARD, RESHARD and REDUCE_GRAD (actions on a whole stage, no microbatch)."""
        return self in FSDP_OPS


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.I, Op.W, Op.OVERLAP_F_B})
COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
FSDP_OPS = frozenset({Op.UNSHARD, Op.RESHARD, Op.REDUCE_GRAD})
_SIMPLE_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_STAGE_RE = re.compile(r"^(\d+)(UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")
_OVERLAP_RE = re.compile(r"^\(([^;()]+);([^;()]+)\)OVERLAP_F_B$")


@dataclass(frozen=True, slots=True)
class Action:
    """One instruction: `op` on `stage` for `microbatch`.

    An OVERLAP_F_B action carries its two parts in `parts` (a forward, then a B or I);
    its own stage and microbatch are those of the forward part. UNSHARD, RESHARD and
    REDUCE_GRAD act on a whole stage: their microbatch is NO_MICROBATCH (build them with
    `Action.on_stage`).
    """

    stage: int
    op: Op
    microbatch: int
    parts: tuple[Action, ...] = field(default=(), compare=True)

    @staticmethod
    def overlap(forward: Action, backward: Action) -> Action:
        """Build the F&B pair `(forward;backward)OVERLAP_F_B`."""
        if forward.op is not Op.F or backward.op not in (Op.B, Op.I):
            raise ValueError(
                f"OVERLAP_F_B needs an F and a B or I part, got {forward} and {backward}"
            )
        return Action(forward.stage, Op.OVERLAP_F_B, forward.microbatch, (forward, backward))

    @staticmethod
    def on_stage(stage: int, op: Op) -> Action:
        """An action on a whole stage (UNSHARD, RESHARD or REDUCE_GRAD), e.g. `0UNSHARD`."""
        if not op.is_fsdp:
            raise ValueError(f"{op.value} acts on a microbatch; only UNSHARD, RESHARD and REDUCE_GRAD act on a stage")
        return Action(stage, op, NO_MICROBATCH)

    def compute_parts(self) -> tuple[Action, ...]:
        """The plain compute actions this action stands for (itself unless a pair)."""
        return self.parts if self.op is Op.OVERLAP_F_B else (self,)

    def __str__(self) -> str:
        return format_action(self)


def format_action(action: Action) -> str:
    """Text form shared with torch.distributed.pipelining, e.g. `2F0`, `(0F7;7B3)OVERLAP_F_B`, `1UNSHARD`."""
    if action.op is Op.OVERLAP_F_B:
        return f"({';'.join(format_action(p) for p in action.parts)})OVERLAP_F_B"
    if action.op in FSDP_OPS:
        return f"{action.stage}{action.op.value}"
    return f"{action.stage}{action.op.value}{action.microbatch}"


def parse_action(text: str) -> Action:
    """Inverse of `format_action`; raises ScheduleError naming the bad token."""
    token = text.strip()
    pair = _OVERLAP_RE.match(token)
    if pair:
        try:
            return Action.overlap(parse_action(pair.group(1)), parse_action(pair.group(2)))
        except ValueError as exc:
            raise ScheduleError(f"bad overlap token {token!r}: {exc}") from None
    simple = _SIMPLE_RE.match(token)
    if not simple:
        whole = _STAGE_RE.match(token)
        if whole and whole.group(3):
            raise ScheduleError(f"bad action token {token!r}: {whole.group(2)} acts on a whole stage and takes no "
                                f"microbatch (write '{whole.group(1)}{whole.group(2)}')")
        if whole:
            return Action(int(whole.group(1)), Op(whole.group(2)), NO_MICROBATCH)
        raise ScheduleError(
            f"bad action token {token!r}: expected STAGE OP MICROBATCH like '2F0', "
            "'1SEND_F4' or '(0F7;7B3)OVERLAP_F_B', or STAGE OP like '0UNSHARD'"
        )
    return Action(int(simple.group(1)), Op(simple.group(2)), int(simple.group(3)))


@dataclass(frozen=True, slots=True)
class StageInfo:
    """Where one stage lives and which model part it is."""

    rank: int
    """The rank that runs this stage."""
    group: int
    """The weight group (model part); mirrored copies of one part share it and sum gradients."""


@dataclass(frozen=True)
class Schedule:
    """A complete pipeline plan: the stage table and one ordered action list per rank.

    Stages form `num_copies` chains of `num_groups` stages each: copy c is stages
    c*G .. c*G+G-1 (G = num_groups) and stage c*G+k holds model part (group) k.
    Microbatches are dealt to copies in equal contiguous blocks (DualPipe: 0..M/2-1
    take copy 0, M/2..M-1 copy 1).
    """

    name: str
    num_ranks: int
    num_microbatches: int
    stages: tuple[StageInfo, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        _check_table(self)

    @property
    def num_stages(self) -> int:
        """How many stages the stage table holds."""
        return len(self.stages)

    @cached_property
    def num_groups(self) -> int:
        """How many distinct model parts (weight groups) there are (computed once: passes ask per action)."""
        return max(s.group for s in self.stages) + 1

    @property
    def num_copies(self) -> int:
        """How many copies of the model the stages hold (2 for DualPipe, else 1)."""
        return self.num_stages // self.num_groups

    def copy_of_stage(self, stage: int) -> int:
        """The model copy (chain) that `stage` belongs to."""
        return stage // self.num_groups

    def copy_of_microbatch(self, microbatch: int) -> int:
        """The model copy (chain) that `microbatch` flows through."""
        per_copy = self.num_microbatches // self.num_copies
        return microbatch // per_copy

    def microbatches_of_stage(self, stage: int) -> range:
        """The microbatches that pass through `stage`."""
        per_copy = self.num_microbatches // self.num_copies
        start = self.copy_of_stage(stage) * per_copy
        return range(start, start + per_copy)

    def next_stage(self, stage: int) -> int | None:
        """The stage after `stage` in its chain (forward direction), or None at its end."""
        return stage + 1 if (stage + 1) % self.num_groups else None

    def prev_stage(self, stage: int) -> int | None:
        """The stage before `stage` in its chain, or None at its start."""
        return stage - 1 if stage % self.num_groups else None

    def is_first(self, stage: int) -> bool:
        """True where the stage reads the model input."""
        return self.prev_stage(stage) is None

    def is_last(self, stage: int) -> bool:
        """True where the stage computes the loss."""
        return self.next_stage(stage) is None

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages that `rank` runs, in stage order."""
        return tuple(i for i, s in enumerate(self.stages) if s.rank == rank)

    @property
    def has_comms(self) -> bool:
        """True when the lists already hold SEND/RECV actions (lowered)."""
        return any(a.op.is_comm for row in self.actions for a in row)

    @property
    def has_fsdp(self) -> bool:
        """True when the lists hold UNSHARD, RESHARD or REDUCE_GRAD actions (ZeRO-3, see `schedules.shard`)."""
        return any(a.op.is_fsdp for row in self.actions for a in row)

    def without_fsdp(self) -> Schedule:
        """The same schedule with every UNSHARD, RESHARD and REDUCE_GRAD removed."""
        rows = tuple(tuple(a for a in row if not a.op.is_fsdp) for row in self.actions)
        return Schedule(self.name, self.num_ranks, self.num_microbatches, self.stages, rows)

    def compute_only(self) -> Schedule:
        """The same schedule with every SEND/RECV removed."""
        rows = tuple(tuple(a for a in row if not a.op.is_comm) for row in self.actions)
        return Schedule(self.name, self.num_ranks, self.num_microbatches, self.stages, rows)

    def iter_actions(self) -> Iterator[tuple[int, int, Action]]:
        """Yield (rank, position, action) over every list."""
        for rank, row in enumerate(self.actions):
            for pos, action in enumerate(row):
                yield rank, pos, action

    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON form (see `from_dict`)."""
        return {
            "format": JSON_FORMAT,
            "version": JSON_VERSION,
            "name": self.name,
            "num_ranks": self.num_ranks,
            "num_microbatches": self.num_microbatches,
            "stages": [{"rank": s.rank, "group": s.group} for s in self.stages],
            "actions": [[format_action(a) for a in row] for row in self.actions],
        }

    def fingerprint(self) -> str:
        """A short hash of the whole plan; equal on every rank that runs the same schedule."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @staticmethod
    def from_dict(data: Any, source: str = "<dict>") -> Schedule:
        """Build a Schedule from its JSON form; raises ScheduleError naming what is wrong."""
        return _schedule_from_dict(data, source)


def _check_table(s: Schedule) -> None:
    if s.num_ranks < 1:
        raise ScheduleError(f"num_ranks must be >= 1, got {s.num_ranks}")
    if s.num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {s.num_microbatches}")
    if not s.stages:
        raise ScheduleError("the stage table is empty")
    if len(s.actions) != s.num_ranks:
        raise ScheduleError(f"expected {s.num_ranks} action lists (one per rank), got {len(s.actions)}")
    for i, info in enumerate(s.stages):
        if not 0 <= info.rank < s.num_ranks:
            raise ScheduleError(f"stage {i} is placed on rank {info.rank}, outside 0..{s.num_ranks - 1}")
    groups = max(info.group for info in s.stages) + 1
    if len(s.stages) % groups:
        raise ScheduleError(f"{len(s.stages)} stages do not form whole copies of {groups} groups")
    for i, info in enumerate(s.stages):
        if info.group != i % groups:
            raise ScheduleError(
                f"stage {i} has group {info.group}, expected {i % groups} (stage c*G+k holds part k)"
            )
    if s.num_microbatches % (len(s.stages) // groups):
        raise ScheduleError(
            f"{s.num_microbatches} microbatches do not split evenly over {len(s.stages) // groups} copies"
        )


def _require(data: dict[str, Any], key: str, kind: type, source: str) -> Any:
    if key not in data:
        raise ScheduleError(f"{source}: missing field {key!r}")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ScheduleError(f"{source}: field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _schedule_from_dict(data: Any, source: str) -> Schedule:
    if not isinstance(data, dict):
        raise ScheduleError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != JSON_FORMAT:
        raise ScheduleError(f"{source}: field 'format' must be {JSON_FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != JSON_VERSION:
        raise ScheduleError(f"{source}: unsupported version {data.get('version')!r}, expected {JSON_VERSION}")
    stages = []
    for i, entry in enumerate(_require(data, "stages", list, source)):
        where = f"{source}: stages[{i}]"
        if not isinstance(entry, dict):
            raise ScheduleError(f"{where}: expected an object with 'rank' and 'group', got {entry!r}")
        stages.append(StageInfo(_require(entry, "rank", int, where), _require(entry, "group", int, where)))
    raw = _require(data, "actions", list, source)
    _check_action_count(raw, len(stages), _require(data, "num_microbatches", int, source), source)
    rows = []
    for rank, row in enumerate(raw):
        if not isinstance(row, list):
            raise ScheduleError(f"{source}: actions of rank {rank} must be a list, got {row!r}")
        rows.append(tuple(_parse_in(tok, f"{source}: rank {rank}, position {pos}")
                          for pos, tok in enumerate(row)))
    try:
        return Schedule(
            name=_require(data, "name", str, source),
            num_ranks=_require(data, "num_ranks", int, source),
            num_microbatches=_require(data, "num_microbatches", int, source),
            stages=tuple(stages),
            actions=tuple(rows),
        )
    except ScheduleError as exc:
        if str(exc).startswith(f"{source}:"):
            raise
        raise ScheduleError(f"{source}: {exc}") from None


def _check_action_count(rows: list[Any], num_stages: int, num_microbatches: int, source: str) -> None:
    """ScheduleError, before any action is parsed, when `rows` hold more actions than MAX_ACTIONS_PER_UNIT per stage
    and microbatch (a file padded with repeats: parsing and verifying them would take minutes)."""
    total = sum(len(row) for row in rows if isinstance(row, list))
    stages = max(num_stages, 1)
    limit = (MAX_ACTIONS_PER_UNIT * max(num_microbatches, 1) + MAX_ACTIONS_PER_STAGE) * stages
    if total > limit:
        raise ScheduleError(f"{source}: {total:,} actions, more than the {limit:,} a schedule of {num_stages} stages "
                            f"and {num_microbatches} microbatches can hold ({MAX_ACTIONS_PER_UNIT} per stage and "
                            "microbatch: F, B, I, W, four transfers, an UNSHARD and RESHARD around each compute and a "
                            "REDUCE_GRAD; one more REDUCE_GRAD per stage); refused before reading them")


def _parse_in(token: Any, where: str) -> Action:
    if not isinstance(token, str):
        raise ScheduleError(f"{where}: expected an action string, got {token!r}")
    try:
        return parse_action(token)
    except ScheduleError as exc:
        raise ScheduleError(f"{where}: {exc}") from None


def save_json(schedule: Schedule, path: str) -> None:
    """Write `schedule` as versioned JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(schedule.to_dict(), fh, indent=1)
        fh.write("\n")


def read_json(path: str, max_bytes: int = MAX_SCHEDULE_FILE_BYTES, what: str = "schedule file") -> Any:
    """The JSON value in `path`; ScheduleError naming the file when it is over `max_bytes` (before it is read) or
    cannot be read or parsed."""
    try:
        return json.loads(read_capped_text(path, max_bytes, what, ScheduleError))
    except OSError as exc:
        raise ScheduleError(f"cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ScheduleError(f"{path}: not valid JSON ({exc})") from None


def json_header(path: str) -> tuple[int | None, int | None]:
    """(num_ranks, num_microbatches) as a schedule JSON file states them before its actions (`save_json` writes
    them first), read from its first 64 KiB without parsing the rest; None for one not found there."""
    try:
        require_regular(path, "schedule file", ScheduleError)
        with open(path, encoding="utf-8", errors="replace") as fh:
            head = fh.read(_HEADER_BYTES)
    except OSError as exc:
        raise ScheduleError(f"cannot read {path}: {exc.strerror}") from None
    head = head.split('"actions"', 1)[0]
    found = {key: int(value) for key, value in _HEADER_FIELD.findall(head)}
    return found.get("num_ranks"), found.get("num_microbatches")


def load_json(path: str, max_bytes: int = MAX_SCHEDULE_FILE_BYTES) -> Schedule:
    """Read a schedule written by `save_json` (refused over `max_bytes` before it is parsed); never unpickles
    anything."""
    return Schedule.from_dict(read_json(path, max_bytes), source=path)


def rows_to_csv(rows: Sequence[Iterable[Action]]) -> str:
    """torch.distributed.pipelining's CSV: one row per rank, one action per cell."""
    return "".join(",".join(format_action(a) for a in row) + "\n" for row in rows)


def save_torch_csv(schedule: Schedule, path: str) -> None:
    """Write the action lists in torch.distributed.pipelining's schedule CSV (with comms if the schedule has them)."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(rows_to_csv(schedule.actions))


def load_torch_csv(path: str, name: str | None = None, num_microbatches: int | None = None,
                   max_bytes: int = MAX_SCHEDULE_FILE_BYTES) -> Schedule:
    """Read a torch.distributed.pipelining schedule CSV (compute-only or with comms; refused over `max_bytes` before it
    is parsed); infer the stage table.

    Stage ranks come from where each stage's actions appear; the stages form one chain.
    Empty cells (torch writes None as an empty cell) are skipped. The FSDP actions torch's
    lowering adds to compute_comms dumps (`0UNSHARD`, `0RESHARD`, `0REDUCE_GRAD`) are kept
    (`Schedule.without_fsdp` drops them).
    """
    import csv
    import io

    try:
        table = list(csv.reader(io.StringIO(read_capped_text(path, max_bytes, "schedule file", ScheduleError),
                                            newline="")))
    except OSError as exc:
        raise ScheduleError(f"cannot read {path}: {exc.strerror}") from None
    rows = [
        tuple(_parse_in(cell, f"{path}: line {line + 1} (rank {line}), column {col + 1}")
              for col, cell in enumerate(row) if cell.strip())
        for line, row in enumerate(table)
    ]
    if not rows:
        raise ScheduleError(f"{path}: no rows; expected one row of actions per rank")
    return schedule_from_rows(rows, name or path, num_microbatches, source=path)


def schedule_from_rows(rows: Sequence[Sequence[Action]], name: str,
                       num_microbatches: int | None = None, source: str = "<rows>") -> Schedule:
    """Build a single-chain Schedule from per-rank lists, inferring stage ranks."""
    stage_rank: dict[int, int] = {}
    max_mb = -1
    for rank, row in enumerate(rows):
        for action in row:
            for part in action.compute_parts():
                max_mb = max(max_mb, part.microbatch)
                if part.op.is_compute or part.op.is_comm or part.op.is_fsdp:
                    known = stage_rank.setdefault(part.stage, rank)
                    if known != rank:
                        raise ScheduleError(
                            f"{source}: stage {part.stage} appears on rank {known} and on rank {rank} "
                            f"({part})"
                        )
    if not stage_rank:
        raise ScheduleError(f"{source}: no actions found")
    num_stages = max(stage_rank) + 1
    missing = [s for s in range(num_stages) if s not in stage_rank]
    if missing:
        raise ScheduleError(f"{source}: stages {missing} have no actions; stages must be 0..{num_stages - 1}")
    stages = tuple(StageInfo(stage_rank[s], s) for s in range(num_stages))
    m = num_microbatches if num_microbatches is not None else max_mb + 1
    try:
        return Schedule(name, len(rows), m, stages, tuple(tuple(r) for r in rows))
    except ScheduleError as exc:
        raise ScheduleError(f"{source}: {exc}") from None
