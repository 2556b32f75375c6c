"""ZeRO-1's sharded optimizer: flat parameter and gradient buffers per (stage, param group), an optimizer that
steps only this data-parallel rank's shard, and the reduce-scatter / all-gather around the step.

Layout (Megatron's distributed optimizer): the trainable parameters of one stage in one optimizer param group
live end to end in a flat buffer (the module's parameters become views into it), cut into DP shards of
ceil(N/DP) elements. Per step: a stage's gradients are copied into its flat gradient buffer once final and
reduce-scattered (each rank receives the mean of its shard); the optimizer steps the shard; the updated shards
are all-gathered back into the parameter buffer: one all-reduce's worth of traffic. Only elementwise optimizers
give the same result on a shard as on whole tensors (checked: see check_elementwise).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from duplexpipe.comm.local_tensors import local_of
from duplexpipe.comm.reduction import WaitFn, blocking_wait
from duplexpipe.comm.sharded import Pending, ShardComm
from duplexpipe.parallel.flat import FlatLayout

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD,
)
"""torch optimizers whose update of an element depends only on that element's own history (and scalars)."""


def check_elementwise(optimizer: torch.optim.Optimizer, trusted: bool = False) -> None:
    """Raise ValueError unless `optimizer` is a known elementwise optimizer (or `trusted`)."""
    if trusted or type(optimizer) in ELEMENTWISE_OPTIMIZERS:
        return
    known = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"ZeRO steps a flat shard of the parameters, which equals stepping whole tensors only for elementwise "
        f"optimizers; got {type(optimizer).__name__} (known elementwise: {known}). Pass "
        "ZeroOptions(trust_elementwise=True) if yours updates every element from that element alone")


@dataclass
class FlatGroup:
    """One flat buffer: this rank's trainable parameters of one stage in one optimizer param group."""

    stage: int
    """The stage the parameters belong to."""
    group: int
    """Index of the optimizer param group."""
    params: list[nn.Parameter]
    """The parameters, in buffer order (each now a view into `data`)."""
    names: list[str]
    """Their checkpoint names (`stage<s>.<name in the stage module>`)."""
    layout: FlatLayout
    """Where each parameter and each rank's shard sit."""
    data: Tensor
    """The flat parameter buffer (padded)."""
    grads: Tensor
    """The flat gradient buffer (padded; padding stays zero)."""
    master: Tensor
    """This rank's shard the optimizer steps: a view into `data`, or its own fp32 copy under qwZ."""
    shard_grad: Tensor
    """This rank's chunk of `grads`, where the (in-place) reduce-scatter leaves the mean gradient shard."""
    rank: int
    """This rank's index in the data-parallel group."""
    index: int
    """The buffer's position among this rank's buffers (stable: it keys the random draws)."""

    @property
    def shard_slice(self) -> slice:
        """This rank's range of the buffers."""
        lo, hi = self.layout.shard_range(self.rank)
        return slice(lo, hi)


def _flatten(params: list[nn.Parameter], size: int, rank: int, own_master: bool) -> tuple[FlatLayout, Tensor, Tensor]:
    """Move `params` into one padded flat buffer (each becomes a view; a DTensor parameter's local shard does)
    and return (layout, data, master)."""
    first = params[0]
    locals_ = [local_of(p) for p in params]
    layout = FlatLayout([t.numel() for t in locals_], size)
    data = torch.zeros(layout.padded, dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for p, local, lo in zip(params, locals_, layout.offsets, strict=False):
            view = data[lo:lo + local.numel()].view_as(local)
            view.copy_(local)
            if isinstance(p, DTensor):
                p._local_tensor = view  # the DTensor's storage (its layout, shape and stride stay)
            else:
                p.data = view
    lo, hi = layout.shard_range(rank)
    master = data[lo:hi].clone() if own_master else data[lo:hi]
    return layout, data, master


Buffer = tuple[int, int, list[nn.Parameter], list[str]]
"""(stage, optimizer param group, parameters, their names): what one flat buffer holds."""


def _buffers_of(optimizer: torch.optim.Optimizer, stage_of: Mapping[int, tuple[int, str]],
                whole: frozenset[int] = frozenset()) -> list[Buffer]:
    """(stage, param group, params, names) per flat buffer: a group's parameters split by stage and dtype
    (those in `whole` left out)."""
    out: list[Buffer] = []
    for g, group in enumerate(optimizer.param_groups):
        split: dict[tuple[int, torch.dtype, torch.device], tuple[list[nn.Parameter], list[str]]] = {}
        for p in group["params"]:
            if id(p) in whole:
                continue
            if id(p) not in stage_of:
                raise ValueError("the optimizer holds a parameter that is not in this rank's stages")
            stage, name = stage_of[id(p)]
            params, names = split.setdefault((stage, p.dtype, p.device), ([], []))
            params.append(p)
            names.append(name)
        for (stage, _, _), (params, names) in sorted(split.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            out.append((stage, g, params, names))
    return out


def _rebuild(optimizer: torch.optim.Optimizer, groups: list[list[Tensor]]) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class and hyperparameters over `groups` (one list per param group)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    spec = [{**{k: v for k, v in group.items() if k != "params"}, "params": params}
            for group, params in zip(optimizer.param_groups, groups, strict=True)]
    try:
        return cls(spec, **kwargs)
    except TypeError as exc:
        raise ValueError(f"ZeRO could not rebuild {cls.__name__} over the parameter shards ({exc}); pass an "
                         "optimizer whose constructor takes its defaults as keyword arguments") from exc


class ShardedOptimizer:
    """Steps only this rank's shards of flat parameter buffers; reduce-scatter before, all-gather after.

    `optimizer` (built by the user's factory over this rank's parameters) supplies the class and the param
    groups' hyperparameters; a fresh instance of its class steps the shards. `names` maps every parameter to
    its checkpoint name and stage; `comm` is None when the data-parallel group has one rank. Parameters in
    `whole` (id()s; e.g. routed experts, which no other data-parallel rank holds) are not sharded: the same
    optimizer steps them whole, in their param group, from gradients the caller reduced.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, tuple[int, str]],
                 comm: ShardComm | None, *, own_master: bool = False, trust_elementwise: bool = False,
                 whole: frozenset[int] = frozenset()) -> None:
        check_elementwise(optimizer, trust_elementwise)
        self.comm = comm
        self.own_master = own_master
        """Whether each master shard is a copy of its own (qwZ) rather than a view of the parameter buffer."""
        size, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
        self.flats: list[FlatGroup] = []
        for stage, g, params, pnames in _buffers_of(optimizer, names, whole):
            layout, data, master = _flatten(params, size, rank, own_master)
            grads = torch.zeros_like(data)
            lo, hi = layout.shard_range(rank)  # the reduce-scatter runs in place: the shard is the own chunk
            self.flats.append(FlatGroup(stage, g, params, pnames, layout, data, grads, master, grads[lo:hi], rank,
                                        len(self.flats)))
        shards: list[list[Tensor]] = [[] for _ in optimizer.param_groups]
        for flat in self.flats:
            shards[flat.group].append(flat.master)
        self.whole = [p for group in optimizer.param_groups for p in group["params"] if id(p) in whole]
        """The parameters stepped whole."""
        for g, group in enumerate(optimizer.param_groups):
            shards[g] += [p for p in group["params"] if id(p) in whole]
        self.optimizer = _rebuild(optimizer, shards)
        self._pending: list[Pending] = []

    def start(self, flat: FlatGroup, draw: int = 0) -> Pending | None:
        """Copy `flat`'s final gradients into its buffer (freeing .grad) and start reduce-scattering it;
        None when there is no group (the shard is the whole buffer)."""
        with torch.no_grad():
            for p, lo in zip(flat.params, flat.layout.offsets, strict=False):
                view = flat.grads[lo:lo + local_of(p).numel()]
                view.copy_(local_of(p.grad).reshape(-1)) if p.grad is not None else view.zero_()
                p.grad = None
        if self.comm is None:
            return None
        what = f"the gradients of stage {flat.stage} (param group {flat.group})"
        pending = self.comm.reduce_scatter(flat.grads, flat.shard_grad, what, draw=draw * 4096 + flat.index,
                                           segments=flat.layout.segments())
        self._pending.append(pending)
        return pending

    def finish(self, wait: WaitFn = blocking_wait) -> None:
        """Wait for every started reduce-scatter; each shard's mean gradient becomes its master's .grad."""
        for pending in self._pending:
            pending.finish(wait)
        self._pending = []
        for flat in self.flats:
            flat.master.grad = flat.shard_grad

    def shard_grads(self, stages: Iterable[int] | None = None,
                    counted: Callable[[nn.Parameter], bool] | None = None) -> list[Tensor]:
        """This rank's reduced gradient shards (of `stages`, or all); with `counted`, only the pieces of the
        parameters it accepts (e.g. a TP-replicated parameter on TP rank 0 only)."""
        keep = None if stages is None else set(stages)
        out: list[Tensor] = []
        for f in self.flats:
            if keep is not None and f.stage not in keep:
                continue
            if counted is None or all(counted(p) for p in f.params):
                out.append(f.shard_grad)
                continue
            out += [f.shard_grad[piece.offset:piece.offset + piece.numel]
                    for piece in f.layout.pieces(f.rank) if counted(f.params[piece.index])]
        return out

    def scale_(self, factor: float) -> None:
        """Multiply every gradient shard by `factor` (skipped when 1)."""
        if factor != 1.0:
            for flat in self.flats:
                flat.shard_grad.mul_(factor)

    def step(self, wait: WaitFn = blocking_wait, draw: int = 0) -> None:
        """Step the shards, then all-gather every buffer's updated shards into the parameters."""
        self.optimizer.step()
        self.gather(wait, draw)

    def gather(self, wait: WaitFn = blocking_wait, draw: int = 0, exact: bool = False) -> None:
        """All-gather every buffer's master shards into the parameters (`exact`: unquantized even under qwZ;
        with a master of its own, this rank's chunk is copied from it first)."""
        pending = []
        for flat in self.flats:
            if self.comm is None or exact:
                flat.data[flat.shard_slice].copy_(flat.master)
            if self.comm is None:
                continue
            what = f"the parameters of stage {flat.stage} (param group {flat.group})"
            # a master viewing its own chunk of `data` (no qwZ) makes an in-place all-gather
            pending.append(self.comm.all_gather(flat.data, flat.data[flat.shard_slice] if exact else flat.master,
                                                what, draw=draw * 4096 + flat.index, exact=exact,
                                                segments=flat.layout.segments()))
        for p in pending:
            p.finish(wait)

    def zero_grad(self) -> None:
        """Drop the shards' gradients (the flat gradient buffers are overwritten at the next reduce)."""
        for flat in self.flats:
            flat.master.grad = None
