"""Step-level group communication: step-start agreement, loss sum, mirrored gradients, outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from duplexpipe.comm.local_tensors import laid_out_like, local_of
from duplexpipe.runtime import structure
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.ir import Schedule

NONE = -(2**62)
"""Placeholder a rank contributes to the agreement for a value it does not know."""
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_HEADER = 10


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on at the start of a step (-1: nobody knew the value)."""

    batch: int
    """Rows of the batch on the ranks holding first stages."""
    signature: int
    """Hash of the microbatch input shapes and dtype."""
    target_rows: int
    """Rows of the targets on the ranks holding last stages; -1 when none were given."""
    error_rank: int
    """A rank that rejected its inputs, or -1."""
    consistent: bool
    """False when ranks holding first (or last) stages were given different batches (or targets)."""


AGREE_TAG = 0xA9EE
"""The tag of the step-start agreement's messages (apart from the pipeline's own)."""
_AGREE_WHAT = "the step-start agreement (every rank must call step()/evaluate())"


def agree(batch: int | None, signature: int | None, target_rows: int | None, error: bool,
          group: Any, device: torch.device, watchdog: Watchdog) -> Agreement:
    """Tell every rank the batch, its signature and the target rows (an element-wise MAX).

    Ranks pass None for what they do not hold; target_rows is -1 on a last-stage rank
    without targets. `error` marks a rank whose inputs are invalid. Every rank sends its
    vector to group rank 0, which reduces and sends the result back: two message latencies
    (a ring all-reduce takes 2(P-1)), and rank 0, usually the last to finish the previous
    step, continues as soon as it has sent.
    """
    def pair(value: int | None) -> list[int]:
        return [NONE, NONE] if value is None else [value, -value]

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    vec = pair(batch) + pair(signature) + pair(target_rows) + [rank if error else -1]
    data = torch.tensor(vec, dtype=torch.int64, device=device)
    if size > 1:
        data = _star_max(data, rank, size, group, watchdog)
    got = data.tolist()
    consistent = all(got[i] == NONE or got[i] == -got[i + 1] for i in (0, 2, 4))
    known = [v if v != NONE else -1 for v in got[0:6:2]]
    return Agreement(known[0], known[1], known[2], int(got[6]), consistent)


def _star_max(data: Tensor, rank: int, size: int, group: Any, watchdog: Watchdog) -> Tensor:
    """The element-wise MAX of every rank's `data`: gathered at group rank 0, sent back from there."""
    pg: Any = group if group is not None else dist.group.WORLD  # its send/recv take group ranks
    if rank != 0:
        sent = pg.send([data], 0, AGREE_TAG)
        result = torch.empty_like(data)
        watchdog.wait_p2p(pg.recv([result], 0, AGREE_TAG), _AGREE_WHAT, "rank 0")
        watchdog.wait_p2p(sent, _AGREE_WHAT, "rank 0")
        return result
    parts = [torch.empty_like(data) for _ in range(1, size)]
    works = [pg.recv([t], r, AGREE_TAG) for r, t in enumerate(parts, start=1)]
    for r, work in enumerate(works, start=1):
        watchdog.wait_p2p(work, _AGREE_WHAT, f"rank {r}")
    result = torch.stack([data, *parts]).amax(dim=0)
    sends = [pg.send([result], r, AGREE_TAG) for r in range(1, size)]
    for r, work in enumerate(sends, start=1):
        watchdog.wait_p2p(work, _AGREE_WHAT, f"rank {r}")
    return result


_SAME_SHAPES = (" (with RuntimeConfig.check_inputs_every_step=False every step() needs a batch shaped like the "
                "one the ranks agreed on, at the first step or the first step after evaluate(); the other "
                "ranks were told to stop)")


class BatchAgreement:
    """Checks each call's agreement and, unless `every_step`, keeps a step's to reuse (no collective)
    while this rank's batch matches it."""

    def __init__(self, every_step: bool, rank: int, holds_last: bool) -> None:
        self.every_step = every_step
        self.rank = rank
        self.holds_last = holds_last
        self._kept: Agreement | None = None
        self._kept_inputs: list[Any] | None = None

    def accept(self, found: Agreement, error: str, train: bool, inputs: Any) -> None:
        """Raise ValueError (on every rank alike) unless the agreed batch can run; keep it when
        it may be reused. `error` is this rank's own complaint, `inputs` its batch (if it holds one)."""
        self._kept = self._kept_inputs = None
        if error:
            raise ValueError(error)
        if found.error_rank >= 0:
            raise ValueError(f"rank {found.error_rank} rejected its step inputs (see its error); "
                             "nothing was run")
        if not found.consistent:
            raise ValueError("the ranks holding first stages (or last stages) were given batches (or "
                             "targets) of different sizes or shapes; nothing was run")
        if found.target_rows >= 0 and found.target_rows != found.batch:
            raise ValueError(f"targets have {found.target_rows} rows but inputs have {found.batch}")
        if train and found.target_rows < 0:
            raise ValueError("step() needs targets on the ranks holding last stages")
        if train and not self.every_step:
            self._kept = found
            self._kept_inputs = structure.signature(inputs) if inputs is not None else None

    def reuse(self, inputs: Any, targets: Any, error: str) -> Agreement | None:
        """The kept agreement when this rank's batch matches it; None when nothing is kept.

        Raises ValueError (expected vs got) on a mismatch: the caller must stop every rank,
        since the ranks without inputs cannot see it and would run with stale shapes.
        """
        found = self._kept
        if found is None:
            return None
        if error:
            raise ValueError(error + _SAME_SHAPES)
        if self._kept_inputs is not None and structure.signature(inputs) != self._kept_inputs:
            raise ValueError(f"rank {self.rank}: expected inputs of "
                             f"{structure.describe_signature(self._kept_inputs)}, got "
                             f"{structure.describe_signature(structure.signature(inputs))}" + _SAME_SHAPES)
        if self.holds_last and structure.rows(targets) != found.target_rows:
            raise ValueError(f"rank {self.rank}: expected targets with {found.target_rows} rows, got "
                             f"{structure.rows(targets)}" + _SAME_SHAPES)
        return found


class PendingSum:
    """A float64 sum over the group, posted at construction; `value()` waits for it (bounded,
    error-flag aware) the first time and remembers the result, or the error."""

    def __init__(self, value: float | Tensor, group: Any, device: torch.device, watchdog: Watchdog,
                 what: str) -> None:
        data = value if isinstance(value, Tensor) else torch.tensor([value], dtype=torch.float64)
        self._data = data.detach().reshape(1).to(device=device, dtype=torch.float64)
        self._work = dist.all_reduce(self._data, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self._watchdog = watchdog
        self._what = what
        self._result: float | None = None
        self._error: BaseException | None = None

    def value(self) -> float:
        """The sum (the same on every rank); waits for it unless done. Re-raises a failed wait."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            try:
                self._watchdog.wait_collective(self._work, self._what, "all ranks of the group")
            except BaseException as exc:
                self._error = exc
                raise
            self._result = float(self._data.item())
            self._work = None
        return self._result


LOSS_TAG = 0x1055
"""The tag of SharedSum's messages (apart from the pipeline's own)."""


class SharedSum:
    """A float64 sum of the values of a few `sources` ranks of the group, each sending its value straight to
    every other rank: with one source (the last stage of 1F1B) P-1 small messages instead of a ring
    all-reduce's 2P(P-1). Every rank posts its receives when this is created; a source calls `share` once
    its value is final; `value()` waits (bounded) and adds the values in source order (the same float
    sum on every rank). gloo only: the tag keeps these messages apart from the pipeline's, which NCCL,
    matching by order alone, would not."""

    def __init__(self, sources: tuple[int, ...], group: Any, device: torch.device, watchdog: Watchdog,
                 what: str) -> None:
        pg: Any = group if group is not None else dist.group.WORLD
        self._pg = pg
        self._rank, self._size = dist.get_rank(group), dist.get_world_size(group)
        self._sources, self._watchdog, self._what = sources, watchdog, what
        self._got = {s: torch.empty(1, dtype=torch.float64, device=device) for s in sources if s != self._rank}
        self._recvs = {s: pg.recv([buf], s, LOSS_TAG) for s, buf in self._got.items()}
        self._sends: list[Any] = []
        self._result: float | None = None
        self._error: BaseException | None = None

    def share(self, value: Tensor) -> None:
        """This source's value: sent to every other rank now."""
        self._got[self._rank] = value.detach().reshape(1).to(torch.float64)
        self._sends = [self._pg.send([self._got[self._rank]], r, LOSS_TAG) for r in range(self._size)
                       if r != self._rank]

    def value(self) -> float:
        """The sum (the same on every rank); waits for it unless done. Re-raises a failed wait."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            try:
                for source, work in self._recvs.items():
                    self._watchdog.wait_p2p(work, self._what, f"rank {source}")
                self._watchdog.wait_p2p(self._sends, self._what, "all ranks of the group")
            except BaseException as exc:
                self._error = exc
                raise
            total = torch.zeros(1, dtype=torch.float64, device=next(iter(self._got.values())).device)
            for source in self._sources:
                total += self._got[source]
            self._result = float(total.item())
            self._recvs, self._sends = {}, []
        return self._result


def sum_over_group(value: float, group: Any, device: torch.device, watchdog: Watchdog, what: str) -> float:
    """The sum of `value` over the group (float64), bounded and error-flag aware."""
    return PendingSum(value, group, device, watchdog, what).value()


def _flat_grads(params: list[Tensor]) -> list[Tensor]:
    """One flat tensor per dtype (in order of first appearance), zeros where grad is None."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:  # a sharded parameter: its local shard (the mirror holds the same shard)
        grad = local_of(p.grad) if p.grad is not None else torch.zeros_like(local_of(p))
        by_dtype.setdefault(p.dtype, []).append(grad.reshape(-1))
    return [torch.cat(parts) for parts in by_dtype.values()]


def _scatter(params: list[Tensor], flats: list[Tensor]) -> None:
    offsets: dict[torch.dtype, int] = {}
    index = {dtype: i for i, dtype in enumerate(dict.fromkeys(p.dtype for p in params))}
    for p in params:
        start, local = offsets.get(p.dtype, 0), local_of(p)
        summed = flats[index[p.dtype]][start:start + local.numel()].view_as(local).clone()
        p.grad = laid_out_like(summed, p.grad if p.grad is not None else p)
        offsets[p.dtype] = start + local.numel()


class MirrorSum:
    """DualPipe: sum the gradients of the stages that share a weight group, across ranks.

    Only this step's contribution is summed: gradients already in .grad when the step
    starts are set aside by `set_aside` (the step holds them) and added back by `sum`.
    """

    def __init__(self, schedule: Schedule, rank: int, modules: dict[int, nn.Module], group: Any,
                 global_ranks: list[int], watchdog: Watchdog) -> None:
        self.modules = modules
        self.group = group
        self.global_ranks = global_ranks
        self.watchdog = watchdog
        self.pairs: list[tuple[int, int, int]] = []
        for stage in sorted(modules, key=lambda s: (schedule.stages[s].group, s)):
            for other, info in enumerate(schedule.stages):
                if other != stage and info.group == schedule.stages[stage].group and info.rank != rank:
                    self.pairs.append((stage, other, info.rank))

    holders: Callable[[int], list[Tensor]] | None = None
    """stage -> the tensors holding its unreduced gradients, when those are not the module's parameters (ZeRO-3:
    FSDP's unsharded parameters, `Residency.grad_holders`); None: the module's parameters."""

    def _params(self, stage: int) -> list[Tensor]:
        if self.holders is not None:
            return self.holders(stage)
        return [p for p in self.modules[stage].parameters() if p.requires_grad]

    def set_aside(self) -> dict[int, list[Tensor | None]]:
        """Set the existing gradients of mirrored stages aside (returned: the step keeps them for `sum`)."""
        stash: dict[int, list[Tensor | None]] = {}
        for stage, _, _ in self.pairs:
            params = self._params(stage)
            stash[stage] = [p.grad for p in params]
            for p in params:
                p.grad = None
        return stash

    def sum(self, stash: dict[int, list[Tensor | None]]) -> None:
        """Exchange this step's gradients with each mirror and sum; restore the ones `set_aside` returned."""
        for stage, other, peer in self.pairs:
            params = self._params(stage)
            if params:
                self._exchange(stage, other, peer, params)
            old_grads = stash.get(stage) or [None] * len(params)
            if len(old_grads) != len(params) and all(g is None for g in old_grads):  # ZeRO-3: first gather
                old_grads = [None] * len(params)
            for p, old in zip(params, old_grads, strict=True):
                if old is not None and p.grad is not None:
                    p.grad = old.add_(p.grad)
                elif old is not None:
                    p.grad = old

    def _exchange(self, stage: int, other: int, peer: int, params: list[Tensor]) -> None:
        what = f"the gradients of stage {other} (mirror of stage {stage}; both must hold the same parameters)"
        summed = []
        for flat in _flat_grads(params):
            buf = torch.empty_like(flat)
            swap([flat], [buf], peer, self.global_ranks, self.group, self.watchdog, what)
            summed.append(flat + buf)
        _scatter(params, summed)


def swap(outgoing: list[Tensor], incoming: list[Tensor | Callable[[], Tensor]], peer: int,
         global_ranks: list[int], group: Any, watchdog: Watchdog, what: str) -> list[Tensor]:
    """Exchange tensors with group rank `peer`: the lower rank sends first, the higher receives first
    (so NCCL, which serializes one pair's transfers, cannot deadlock). An incoming entry may be a
    callable building its buffer once the previous ones arrived (e.g. from a received header)."""
    address = global_ranks[peer]

    def send_all() -> list[Any]:
        return [dist.isend(t.contiguous(), dst=address, group=group) for t in outgoing]

    def receive_all() -> list[Tensor]:
        got = []
        for entry in incoming:
            buf = entry() if callable(entry) else entry
            watchdog.wait_p2p(dist.irecv(buf, src=address, group=group), what, f"rank {peer}")
            got.append(buf)
        return got

    if watchdog.rank < peer:
        sends = send_all()
        received = receive_all()
    else:
        received = receive_all()
        sends = send_all()
    for work in sends:
        watchdog.wait_p2p(work, f"completion of sending {what}", f"rank {peer}")
    return received


def _header(tensor: Tensor, device: torch.device) -> Tensor:
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot share an output of shape {tuple(tensor.shape)} and dtype {tensor.dtype}")
    vals = [tensor.dim(), *tensor.shape] + [0] * (_HEADER - 2 - tensor.dim()) + [_DTYPES.index(tensor.dtype)]
    return torch.tensor(vals, dtype=torch.int64, device=device)


def share_blocks(block: Tensor, peers: list[int], global_ranks: list[int], group: Any,
                 device: torch.device, watchdog: Watchdog) -> dict[int, Tensor]:
    """Send `block` to every peer (group ranks) and receive each peer's block (any shape)."""
    out: dict[int, Tensor] = {}
    for peer in peers:
        head = torch.empty(_HEADER, dtype=torch.int64, device=device)

        def body(head: Tensor = head) -> Tensor:
            vals = head.tolist()
            return torch.empty(vals[1:1 + vals[0]], dtype=_DTYPES[vals[-1]], device=device)

        _, out[peer] = swap([_header(block, device), block], [head, body], peer, global_ranks, group,
                            watchdog, "a peer's evaluation outputs")
    return out
