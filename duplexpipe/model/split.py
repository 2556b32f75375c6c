"""Model to parts: split a list of layers into the schedule's model parts and report the balance."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from duplexpipe.planner.partition import balanced_split
from duplexpipe.runtime.structure import WHOLE_MESSAGE, flatten, map_leaves
from duplexpipe.schedules.ir import Schedule

Balance = str | Sequence[int]
"""How to balance: "uniform", "params", "time", or an explicit layer count per part."""

BALANCE_METHODS = ("uniform", "params", "time")


@dataclass(frozen=True)
class PartInfo:
    """One model part (weight group) of a partition."""

    index: int
    """The model part index (the weight group of the stages that hold it)."""
    layers: range
    """The indices of the blocks this part holds, in the list that was split."""
    num_params: int
    """Parameters in the part, embedding and head included."""
    est_time_s: float | None
    """Profiled forward+backward seconds for one sample batch (None when not profiled)."""
    has_embedding: bool = False
    """True when the embedding runs at the start of this part."""
    has_head: bool = False
    """True when the head runs at the end of this part."""
    placement: tuple[tuple[int, int], ...] = ()
    """(stage, rank) of every stage that runs this part (filled by `Partition.placed`)."""


@dataclass(frozen=True)
class Partition:
    """How the layers were split into model parts; `str()` gives a readable table."""

    method: str
    """The balancing method: "uniform", "params", "time" or "explicit"."""
    balance: tuple[int, ...]
    """Blocks per part."""
    parts: tuple[PartInfo, ...]
    """One entry per model part, in order."""

    @property
    def num_parts(self) -> int:
        """How many model parts there are."""
        return len(self.parts)

    def placed(self, schedule: Schedule) -> Partition:
        """The same partition with each part's (stage, rank) placement from `schedule`."""
        check_parts_fit(self.num_parts, schedule)
        where: dict[int, list[tuple[int, int]]] = {k: [] for k in range(self.num_parts)}
        for stage, info in enumerate(schedule.stages):
            where[info.group].append((stage, info.rank))
        parts = tuple(replace(p, placement=tuple(where[p.index])) for p in self.parts)
        return replace(self, parts=parts)

    def __str__(self) -> str:
        head = f"{'part':>4}  {'blocks':<12} {'whole params':>12}  {'est. time':>10}  placement (stage@rank)"
        lines = [f"partition ({self.method}, balance {list(self.balance)})", head]
        for p in self.parts:
            blocks = f"{p.layers.start}..{p.layers.stop - 1}" if len(p.layers) else "-"
            extra = ("+emb " if p.has_embedding else "") + ("+head" if p.has_head else "")
            est = f"{p.est_time_s * 1e3:8.2f}ms" if p.est_time_s is not None else f"{'-':>10}"
            where = " ".join(f"{s}@{r}" for s, r in p.placement) or "-"
            lines.append(f"{p.index:>4}  {blocks + ' ' + extra:<12} {p.num_params:>12,}  {est}  {where}")
        return "\n".join(lines)


def check_parts_fit(num_parts: int, schedule: Schedule) -> None:
    """Raise ValueError unless `num_parts` equals the schedule's number of model parts."""
    if num_parts != schedule.num_groups:
        raise ValueError(
            f"schedule {schedule.name!r} on {schedule.num_ranks} ranks needs {schedule.num_groups} "
            f"model parts, got {num_parts}"
        )


def as_layers(model: nn.Sequential | Sequence[nn.Module]) -> list[nn.Module]:
    """The blocks of an nn.Sequential or a list of modules."""
    layers = list(model.children()) if isinstance(model, nn.Sequential) else list(model)
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer {i} is a {type(layer).__name__}, not an nn.Module")
    return layers


def count_params(module: nn.Module | None) -> int:
    """Number of parameter elements in `module` (0 for None)."""
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def uniform_balance(num_layers: int, num_parts: int) -> tuple[int, ...]:
    """Layer counts differing by at most one; the first parts take the remainder."""
    check_split_size(num_layers, num_parts)
    base, extra = divmod(num_layers, num_parts)
    return tuple(base + (1 if k < extra else 0) for k in range(num_parts))


def check_split_size(num_layers: int, num_parts: int) -> None:
    """Raise ValueError for impossible splits (no parts, more parts than layers)."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if num_parts > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_parts} model parts: "
            "every part needs at least one layer"
        )


def check_balance(balance: Sequence[int], num_layers: int, num_parts: int) -> tuple[int, ...]:
    """Validate an explicit balance list; return it as a tuple."""
    counts = tuple(balance)
    if len(counts) != num_parts:
        raise ValueError(
            f"balance {list(counts)} has {len(counts)} entries, the schedule needs {num_parts} parts")
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise ValueError(f"balance {list(counts)}: every entry must be an integer >= 1")
    if sum(counts) != num_layers:
        raise ValueError(
            f"balance {list(counts)} sums to {sum(counts)}, but the model has {num_layers} layers")
    return counts


def _timed_fwd_bwd(module: nn.Module, x: Any, repeats: int, what: str = "the module") -> tuple[float, Any]:
    """Best-of-`repeats` forward+backward seconds of `module` on `x`, a tensor or a structure passed as one
    argument (after one untimed warm-up run); StructureError naming `what` when its output holds no tensor."""
    best, out = float("inf"), None
    for attempt in range(repeats + 1):
        inp = map_leaves(lambda t: t.detach().requires_grad_(t.is_floating_point()), x)
        module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = module(inp)
        roots = [t for t in flatten(out, f"the output of {what}")[1] if t.requires_grad]
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        if attempt:
            best = min(best, time.perf_counter() - start)
    module.zero_grad(set_to_none=True)
    assert out is not None
    return best, map_leaves(torch.Tensor.detach, out)


def profile_layers(
    layers: Sequence[nn.Module],
    sample_input: Any,
    *,
    embedding: nn.Module | None = None,
    head: nn.Module | None = None,
    repeats: int = 3,
) -> tuple[list[float], float, float]:
    """Forward+backward seconds per layer (best of `repeats`), then the embedding's and head's.

    Runs the layers in order on `sample_input` (one sample batch), so each layer sees its real
    input shape. Gradients are cleared afterwards.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    x, emb_t, head_t = sample_input, 0.0, 0.0
    if embedding is not None:
        emb_t, x = _timed_fwd_bwd(embedding, x, repeats, "the embedding")
    times = []
    for index, layer in enumerate(layers):
        t, x = _timed_fwd_bwd(layer, x, repeats, f"layer {index} ({type(layer).__name__})")
        times.append(t)
    if head is not None:
        head_t, x = _timed_fwd_bwd(head, x, repeats, "the head")
    return times, emb_t, head_t


def _costs_with_ends(costs: Sequence[float], first: float, last: float) -> list[float]:
    out = [float(c) for c in costs]
    out[0] += first
    out[-1] += last
    return out


def plan_partition(
    layers: Sequence[nn.Module],
    num_parts: int,
    balance: Balance = "uniform",
    *,
    embedding: nn.Module | None = None,
    head: nn.Module | None = None,
    sample_input: Any = None,
) -> Partition:
    """Decide how many blocks each model part holds and describe the result.

    `balance` is "uniform" (equal block counts), "params" (equal parameter counts, embedding
    and head counted in the first and last part), "time" (equal profiled forward+backward time
    on `sample_input`), or an explicit list of block counts. With a `sample_input` every method
    reports profiled times per part.
    """
    n = len(layers)
    times: tuple[list[float], float, float] | None = None
    meta = any(p.is_meta for m in (*layers, embedding, head) if m is not None for p in m.parameters())
    if meta and balance == "time":
        raise ValueError("balance='time' profiles the layers, which are on the meta device; use 'params', "
                         "'uniform' or a list of counts")
    if sample_input is not None and not meta:  # meta layers have nothing to time
        times = profile_layers(layers, sample_input, embedding=embedding, head=head)
    if isinstance(balance, str):
        if balance not in BALANCE_METHODS:
            raise ValueError(
                f"unknown balance {balance!r}; expected one of {BALANCE_METHODS} or a list of counts")
        method = balance
        if balance == "uniform":
            counts = uniform_balance(n, num_parts)
        elif balance == "params":
            check_split_size(n, num_parts)
            params = [count_params(m) for m in layers]
            ends = (count_params(embedding), count_params(head))
            counts = tuple(balanced_split(_costs_with_ends(params, *ends), num_parts))
        else:
            if times is None:
                raise ValueError("balance='time' needs a sample_input to profile the layers on")
            check_split_size(n, num_parts)
            counts = tuple(balanced_split(_costs_with_ends(*times), num_parts))
    else:
        check_split_size(n, num_parts)
        method, counts = "explicit", check_balance(balance, n, num_parts)
    return _describe(layers, counts, method, embedding, head, times)


def _describe(
    layers: Sequence[nn.Module],
    counts: tuple[int, ...],
    method: str,
    embedding: nn.Module | None,
    head: nn.Module | None,
    times: tuple[list[float], float, float] | None,
) -> Partition:
    parts, start = [], 0
    last = len(counts) - 1
    for k, count in enumerate(counts):
        span = range(start, start + count)
        params = sum(count_params(layers[i]) for i in span)
        params += count_params(embedding) if k == 0 else 0
        params += count_params(head) if k == last else 0
        est = None
        if times is not None:
            est = sum(times[0][i] for i in span)
            est += (times[1] if k == 0 else 0.0) + (times[2] if k == last else 0.0)
        parts.append(PartInfo(k, span, params, est, embedding is not None and k == 0,
                              head is not None and k == last))
        start += count
    return Partition(method, counts, tuple(parts))


def build_parts(
    layers: Sequence[nn.Module],
    partition: Partition,
    *,
    embedding: nn.Module | None = None,
    head: nn.Module | None = None,
) -> list[nn.Sequential]:
    """One nn.Sequential per model part; children are named `embedding`, `layer<i>`, `head`.

    The layer names use the global block index, so a part's state_dict keys do not depend on
    how the model was split. Each part takes its input whole (`WHOLE_MESSAGE`): a tuple or dict a
    layer returns reaches the next layer as one argument, as in `nn.Sequential(*layers)`, whether
    the next layer sits in the same part or behind a stage boundary.
    """
    parts = []
    for info in partition.parts:
        children: OrderedDict[str, nn.Module] = OrderedDict()
        if info.has_embedding and embedding is not None:
            children["embedding"] = embedding
        for i in info.layers:
            children[f"layer{i}"] = layers[i]
        if info.has_head and head is not None:
            children["head"] = head
        part = nn.Sequential(children)
        setattr(part, WHOLE_MESSAGE, True)
        parts.append(part)
    return parts


def split_model(
    model: nn.Sequential | Sequence[nn.Module],
    num_parts: int,
    balance: Balance = "uniform",
    *,
    embedding: nn.Module | None = None,
    head: nn.Module | None = None,
    sample_input: Any = None,
) -> tuple[list[nn.Sequential], Partition]:
    """Split `model` (an nn.Sequential or a list of blocks) into `num_parts` model parts.

    The optional `embedding` runs first in part 0 and the optional `head` last in the final
    part. Returns the parts (sharing the given modules, not copies) and the `Partition`.
    """
    layers = as_layers(model)
    partition = plan_partition(layers, num_parts, balance, embedding=embedding, head=head,
                               sample_input=sample_input)
    return build_parts(layers, partition, embedding=embedding, head=head), partition
