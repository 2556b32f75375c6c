"""Activation checkpointing that recomputes a region once per backward, however many engine calls it takes.

torch's non-reentrant `torch.utils.checkpoint.checkpoint` recomputes a region's forward in every new engine call
that unpacks one of its saved tensors. The split backward makes several (I, then W's calls), so a region would be
recomputed at I and again in W; and a selective policy's cache (`create_selective_checkpoint_contexts`) refuses a
second recompute outright. Here the region is recomputed once, at the first unpack, and each recomputed tensor
lives on its holder (the object autograd saved in the tensor's place) until it is unpacked for the last time:

* a node's unpack drops the tensor, unless the node runs again later: `graph.stage_backward_input` marks the
  intermediates that W restarts at (`saved_again`), so what W needs stays from I to W and nothing else does;
* what no node unpacks (a branch I skips and W never runs) lives as long as the graph that holds its holder;
* should a node unpack a tensor already dropped (a graph run again with retain_graph), the region is recomputed
  again, refilling every holder then empty: slower, never wrong.

Otherwise it runs as torch's does: the forward saves nothing of the region, the recompute restores the forward's
RNG state and autocast, stops once every saved tensor is recomputed, and runs under the policy's contexts
(`context_fn`: torch's pair of forward and recompute contexts, e.g. `create_selective_checkpoint_contexts`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import get_device_states, noop_context_fn, set_device_states

from duplexpipe.errors import RecomputeDone
from duplexpipe.runtime.backward import compat

SAVED_AGAIN = "duplexpipe_saved_again"
"""The key of an autograd node's metadata marking that the node runs again in a later engine call (W)."""
ContextFn = Callable[[], tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]]
"""torch's `context_fn`: () -> (the forward's context, the recompute's context)."""


class RecomputeWatch:
    """The regions checkpointed while it collects (a measured step's forwards): what their recomputes hold now, from
    the recompute to each tensor's last unpack (under a split backward, what W needs from I to W), and a call after
    every recompute, when a region's recomputed tensors are all held at once (a memory measurement samples then)."""

    def __init__(self, on_recompute: Callable[[], None] | None = None) -> None:
        self.on_recompute = on_recompute
        self.regions: list[weakref.ref[_Region]] = []

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Inside the block, each checkpointed region created joins this watch."""
        token = _WATCH.set(self)
        try:
            yield
        finally:
            _WATCH.reset(token)

    def held(self) -> list[Tensor]:
        """The recomputed tensors its live regions hold now, and what a selective policy's cache still keeps for
        their recomputes (`cached`); regions whose graph is gone are dropped."""
        out: list[Tensor] = []
        live: list[weakref.ref[_Region]] = []
        for ref in self.regions:
            region = ref()
            if region is None:
                continue
            live.append(ref)
            out.extend(cached(region.recompute_context))
            for ref_holder in region.holders:
                holder = ref_holder()
                if holder is not None and holder.tensor is not None:
                    out.append(holder.tensor)
        self.regions = live
        return out


def cached(context: object) -> list[Tensor]:
    """The tensors a selective policy's recompute context (torch's `create_selective_checkpoint_contexts`) keeps for
    its recompute: the outputs the forward saved, until the recompute takes them (then a holder has them); none for
    another context."""
    storage = getattr(context, "storage", None)
    if not isinstance(storage, dict):
        return []
    out = []
    for entries in storage.values():
        for entry in entries.values() if isinstance(entries, dict) else ():
            for leaf in tree_leaves(entry):
                value = getattr(leaf, "val", leaf)
                if isinstance(value, Tensor):
                    out.append(value)
    return out


_WATCH: ContextVar[RecomputeWatch | None] = ContextVar("duplexpipe_recompute_watch", default=None)
"""The watch collecting the regions checkpointed now (`RecomputeWatch.collecting`); None outside one."""


class _Holder:
    """What autograd saves in place of one tensor of a region: its index, and the tensor once recomputed."""

    __slots__ = ("__weakref__", "index", "region", "tensor")

    def __init__(self, region: _Region, index: int) -> None:
        self.region = region
        self.index = index
        self.tensor: Tensor | None = None


class _Region:
    """One run of a checkpointed function: what its recompute needs, and weak references to its holders."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 recompute_context: contextlib.AbstractContextManager[Any]) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.recompute_context = recompute_context
        self.holders: list[weakref.ref[_Holder]] = []
        self.recomputes = 0
        self.watch = _WATCH.get()
        """The watch collecting it (None: none)."""
        if self.watch is not None:
            self.watch.regions.append(weakref.ref(self))
        self.device_type = next((a.device.type for a in args if isinstance(a, Tensor) and a.device.type != "cpu"),
                                "cpu")
        self.cpu_rng = torch.get_rng_state()
        module = getattr(torch, self.device_type, None)
        self.devices: list[int] = []
        self.device_states: list[Tensor] = []
        if self.device_type != "cpu" and getattr(module, "_initialized", False):
            self.devices, self.device_states = get_device_states(*args)
        self.autocast = {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                         for kind in dict.fromkeys(("cpu", self.device_type))}
        self.autocast_cache = torch.is_autocast_cache_enabled()

    def pack(self, tensor: Tensor) -> _Holder:
        holder = _Holder(self, len(self.holders))
        self.holders.append(weakref.ref(holder))
        return holder

    def recompute(self, wanted: _Holder) -> None:
        """Run the forward again, filling every live holder left empty (by a drop too: a graph run again needs them
        all again)."""
        self.recomputes += 1
        count = len(self.holders)
        seen = [0]
        holders = self.holders  # the hook below must not hold the region: autograd keeps a hook that raised alive

        def pack(tensor: Tensor) -> Tensor:
            index = seen[0]
            seen[0] += 1
            if index >= count:
                raise RuntimeError("activation checkpointing: the recompute saved more tensors than the forward "
                                   "did; the checkpointed function must run the same operations every time")
            holder = holders[index]()
            if holder is not None and holder.tensor is None:
                holder.tensor = tensor.detach() if tensor.requires_grad else tensor
            if seen[0] == count:
                raise RecomputeDone
            return tensor.detach()  # the recomputed graph keeps nothing of it

        devices = self.devices if self.device_states else []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=self.device_type))
            torch.set_rng_state(self.cpu_rng)
            if self.device_states:
                set_device_states(self.devices, self.device_states, device_type=self.device_type)
            for kind, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _identity))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(self.recompute_context)
            try:
                self.fn(*self.args, **self.kwargs)
            except RecomputeDone:
                pass
        if wanted.tensor is None:  # the recompute stopped short
            raise RuntimeError("activation checkpointing: the recompute saved fewer tensors than the forward did; "
                               "the checkpointed function must run the same operations every time")


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _unpack(holder: _Holder) -> Tensor:
    if holder.tensor is None:
        holder.region.recompute(holder)
        watch = holder.region.watch
        if watch is not None and watch.on_recompute is not None:
            watch.on_recompute()
    tensor = holder.tensor
    assert tensor is not None
    node = compat.current_autograd_node()
    if node is None or not node.metadata.get(SAVED_AGAIN, False):
        holder.tensor = None
    return tensor


def checkpoint(fn: Callable[..., Any], *args: Any, context_fn: ContextFn = noop_context_fn, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, its saved tensors recomputed in backward, once (module docstring); `context_fn` as
    torch's. Under no_grad it is a plain call."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    forward_context, recompute_context = context_fn()
    region = _Region(fn, args, kwargs, recompute_context)
    with torch.autograd.graph.saved_tensors_hooks(region.pack, _unpack), forward_context:
        return fn(*args, **kwargs)


@contextlib.contextmanager
def saved_again(nodes: Iterable[Any]) -> Iterator[None]:
    """Inside the block, `nodes` keep what they unpack of a checkpointed region: they run again later (at W)."""
    marked = list(nodes)
    for node in marked:
        node.metadata[SAVED_AGAIN] = True
    try:
        yield
    finally:
        for node in marked:
            node.metadata.pop(SAVED_AGAIN, None)
