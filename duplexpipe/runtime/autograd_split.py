"""Split a stage's backward into input gradients now (I) and weight gradients later (W).

Works on any autograd graph (plain nn.Linear, LayerNorm, attention; no custom autograd
functions). The idea, learned from torch.distributed.pipelining's stage_backward_input /
stage_backward_weight, implemented here independently:

* the *input path* is every graph node from which the stage input is reachable;
* a parameter's *meeting points* are the input-path nodes (or graph roots off that path)
  where its gradient branch leaves the input path (a Linear's addmm node, a LayerNorm node);
* I computes d(input) only, with pre-hooks on the meeting points recording the gradient
  each receives; autograd then skips every weight branch, so no weight gradient is formed;
* W restarts autograd at the meeting points with the recorded gradients and asks only for
  the parameters: the engine runs each meeting node once more for its weight outputs and the
  weight-only branches below it. It never re-runs the input path (except where one weight
  group meets it at several points, e.g. a weight tied across layers of one stage; there the
  recorded gradients are pinned so nothing is counted twice).
* a stage whose inputs take no gradient (a first stage) has nothing to do at I: its graph is not analysed and W
  runs its whole backward, once (torch's pipelining does the same).

The analysis walks each microbatch's graph once; the parameters' gradient accumulators are read off that walk
(never looked up per parameter: under tensor parallelism each lookup is a DTensor operator dispatch). Nothing of it
is cached across microbatches: every forward builds new nodes, a leaf's accumulator may be replaced between two
forwards (a dtype or device change), and a compiled region's kind changes once its backward is compiled.

Compiled regions (torch.compile) are single graph nodes (`compiled_split.region_kind`). A region compiled by
`compiled_split.SplitBackend` is marked before I: its run then executes only its I graph, and W restarts at it
like at any meeting point, running its W graph. A region compiled otherwise (OPAQUE) can only run its backward
whole, once: the parameter groups that meet the input path at one are formed at I (their parameters join the I's
`autograd.grad`) and their gradients handed to W, which accumulates them; nothing is recomputed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from duplexpipe.runtime.comm_points import BackwardMode
from duplexpipe.runtime.compiled_split import RegionKind, mark, marked, region_kind, retained_regions

Edge = GradientEdge
_ACCUMULATE: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
"""The node type through which a leaf (a parameter, a stage input) receives its gradient."""


@dataclass
class _Group:
    """Parameters whose gradient branches leave the input path at the same meeting points."""

    params: list[Tensor] = field(default_factory=list)
    nodes: set[Node] = field(default_factory=set)


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from `roots`, mapped to the nodes that feed gradient into it."""
    parents: dict[Node, list[Node]] = {root: [] for root in roots}
    stack = list(parents)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _leaves(parents: dict[Node, list[Node]]) -> dict[int, Node]:
    """id(leaf tensor) -> its gradient accumulator, for every leaf the graph reaches: read off the graph itself (each
    AccumulateGrad node holds its tensor), so no parameter is looked up on its own (a DTensor's lookup is an
    operator dispatch) and a leaf whose accumulator was replaced (e.g. by a dtype change) is found as it is now."""
    return {id(node.variable): node for node in parents if type(node) is _ACCUMULATE}  # type: ignore[attr-defined]


def _ancestors(starts: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """The nodes from which some node of `starts` is reachable (including those nodes)."""
    seen = {node for node in starts if node in parents}
    stack = list(seen)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _meeting_points(start: Node, parents: dict[Node, list[Node]], input_path: set[Node],
                    roots: set[Node]) -> set[Node]:
    """Where the gradient branch that ends in `start` (a parameter) leaves the input path."""
    found: set[Node] = set()
    seen, stack = {start}, [start]
    while stack:
        node = stack.pop()
        if node in roots and node not in input_path:
            found.add(node)
        for parent in parents.get(node, ()):
            if parent in input_path:
                found.add(parent)
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return found


def _group_params(params: Sequence[Tensor], parents: dict[Node, list[Node]], input_path: set[Node],
                  roots: set[Node], leaves: dict[int, Node]) -> list[_Group]:
    """Partition the used parameters into groups with disjoint meeting points."""
    groups: list[_Group | None] = []
    owner: dict[Node, int] = {}
    for param in params:
        node = leaves.get(id(param)) if param.grad_fn is None else param.grad_fn
        points = _meeting_points(node, parents, input_path, roots) if node is not None else set()
        if not points:
            continue  # not used by this stage's graph
        merged = _Group([param], set(points))
        for index in sorted({owner[n] for n in points if n in owner}):
            old = groups[index]
            if old is not None:
                merged.params = old.params + merged.params
                merged.nodes |= old.nodes
                groups[index] = None
        groups.append(merged)
        for node in merged.nodes:
            owner[node] = len(groups) - 1
    return [g for g in groups if g is not None]


class WeightWork:
    """The deferred W of one stage backward; `run()` accumulates the weight gradients once."""

    def __init__(self, groups: list[_Group], captured: dict[Node, tuple[Tensor | None, ...]],
                 root_grads: dict[Node, list[tuple[Edge, Tensor]]], formed: list[tuple[Tensor, Tensor | None]],
                 compiled: bool = False, whole: bool = False) -> None:
        self._groups = groups
        self._captured = captured
        self._root_grads = root_grads
        self._formed = formed
        self._compiled = compiled
        self._whole = whole
        """W is the stage's whole backward (nothing ran at I): one engine call that frees the graph as it goes."""
        self.done = False
        self.formed_at_input = len(formed)
        """Parameters whose gradients I formed (they met the input path in an opaque compiled region)."""

    def _edges(self, group: _Group) -> tuple[list[Edge], list[Tensor]]:
        edges: list[Edge] = []
        grads: list[Tensor] = []
        for node in group.nodes:
            if node in self._root_grads:
                for edge, root_grad in self._root_grads[node]:
                    edges.append(edge)
                    grads.append(root_grad)
            for nr, grad in enumerate(self._captured.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, nr))
                    grads.append(grad)
        return edges, grads

    def run(self) -> None:
        """Compute and accumulate (into .grad) the gradients of every parameter reached."""
        if self.done:
            raise RuntimeError("this weight-gradient work has already run")
        self.done = True
        if self._formed:
            accumulate([p for p, _ in self._formed], [g for _, g in self._formed])
        if self._whole:
            self._run_whole()
        else:
            with retained_regions() if self._compiled else contextlib.nullcontext():
                self._run_groups()
        self._groups, self._captured, self._root_grads, self._formed = [], {}, {}, []

    def _run_whole(self) -> None:
        """The whole backward from the roots, once (no graph kept: nothing runs on it after W)."""
        (group,) = self._groups
        edges = [edge for pairs in self._root_grads.values() for edge, _ in pairs]
        grads = [grad for pairs in self._root_grads.values() for _, grad in pairs]
        accumulate(group.params, torch.autograd.grad(edges, group.params, grads, allow_unused=True))

    def _run_groups(self) -> None:
        for group in self._groups:
            edges, grads = self._edges(group)
            if not edges:
                continue
            handles = []
            if len(group.nodes) > 1:  # pin recorded gradients: no double counting
                for node in group.nodes:
                    if node in self._captured:
                        saved = self._captured[node]
                        handles.append(node.register_prehook(lambda _grads, saved=saved: saved))
            try:
                weight_grads = torch.autograd.grad(edges, group.params, grads, retain_graph=True,
                                                   allow_unused=True)
            finally:
                for handle in handles:
                    handle.remove()
            accumulate(group.params, weight_grads)


def accumulate(params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    """Add each gradient to its parameter's .grad (None: skipped), as autograd's accumulation does."""
    with torch.no_grad():
        for param, grad in zip(params, grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad.detach()
            else:
                param.grad += grad


def backward_input(roots: Sequence[Edge], grads: Sequence[Tensor], inputs: Sequence[Tensor],
                   params: Sequence[Tensor]) -> tuple[list[Tensor | None], WeightWork]:
    """I: gradients of `inputs` only, plus the WeightWork that later forms the weight gradients.

    `roots` are the gradient edges of the stage outputs (or of the loss), `grads` the
    gradients flowing into them; `inputs` are the stage's input leaves (those that do not
    require grad get None); `params` the parameters that should receive gradients.
    """
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted:
        return [None] * len(inputs), _whole_backward(roots, grads, params)
    root_nodes = list(dict.fromkeys(edge.node for edge in roots))
    parents = _parents(root_nodes)
    leaves = _leaves(parents)
    input_path = _ancestors([leaves[id(t)] for t in wanted if id(t) in leaves], parents)
    root_set = set(root_nodes)
    groups = _group_params([p for p in params if p.requires_grad], parents, input_path, root_set, leaves)
    kinds = {node: region_kind(node) for node in parents}
    now, later = _when_formed(groups, input_path, kinds)
    root_grads: dict[Node, list[tuple[Edge, Tensor]]] = {}
    for edge, grad in zip(roots, grads, strict=True):
        if edge.node not in input_path:
            root_grads.setdefault(edge.node, []).append((edge, grad))
    captured: dict[Node, tuple[Tensor | None, ...]] = {}

    def recorder(node: Node) -> Any:
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            captured[node] = tuple(grad_outputs)
        return hook

    on_input = {node for group in later for node in group.nodes if node in input_path}
    split = {node for node in on_input if kinds[node] is RegionKind.SPLIT}
    split -= {node for group in now for node in group.nodes}  # a region that forms a group at I runs whole
    early = [p for group in now for p in group.params]
    hooks = [node.register_prehook(recorder(node)) for node in on_input]
    on_path = [t for t in wanted if leaves.get(id(t)) in input_path]
    found: Sequence[Tensor | None] = ()
    compiled = any(kind is not RegionKind.EAGER for kind in kinds.values())
    try:
        for node in split:
            mark(node, BackwardMode.INPUTS)
        if on_path:
            with retained_regions() if compiled else contextlib.nullcontext():
                found = torch.autograd.grad(list(roots), on_path + early, list(grads), retain_graph=True,
                                            allow_unused=True)
    finally:
        for handle in hooks:
            handle.remove()
        _check_split(split, captured)
    by_id = {id(t): g for t, g in zip(on_path, found, strict=False)} if on_path else {}
    dinputs = [by_id.get(id(t)) if t.requires_grad else None for t in inputs]
    formed = list(zip(early, found[len(on_path):], strict=True)) if found else []
    return dinputs, WeightWork(later, captured, root_grads, formed, compiled)


def _whole_backward(roots: Sequence[Edge], grads: Sequence[Tensor], params: Sequence[Tensor]) -> WeightWork:
    """A stage whose inputs take no gradient (a first stage): I has nothing to compute, so the graph is not analysed
    at all and W runs the whole backward, once (torch's pipelining does the same on its first stage)."""
    root_grads: dict[Node, list[tuple[Edge, Tensor]]] = {}
    for edge, grad in zip(roots, grads, strict=True):
        root_grads.setdefault(edge.node, []).append((edge, grad))
    used = [p for p in params if p.requires_grad]
    groups = [_Group(used, set(root_grads))] if used else []
    return WeightWork(groups, {}, root_grads, [], whole=bool(used))


def _when_formed(groups: list[_Group], input_path: set[Node],
                 kinds: dict[Node, RegionKind]) -> tuple[list[_Group], list[_Group]]:
    """(groups formed at I, groups deferred to W): a group meeting the input path in an opaque compiled region
    is formed at I (that region runs its whole backward, once, at I)."""
    now: list[_Group] = []
    later: list[_Group] = []
    for group in groups:
        opaque = any(kinds.get(n) is RegionKind.OPAQUE for n in group.nodes if n in input_path)
        (now if opaque else later).append(group)
    return now, later


def _check_split(split: set[Node], captured: dict[Node, tuple[Tensor | None, ...]]) -> None:
    """After I: every split region that ran ran only its I graph (its node now waits for W); one that did not run
    is unmarked. A region that ran whole would have dropped its weight gradients: refuse, never train on that."""
    for node in split:
        if marked(node) is BackwardMode.INPUTS:
            mark(node, None)
            if node in captured:
                raise RuntimeError(f"a compiled region ({node.name()}) ran its whole backward at I, so its weight "
                                   "gradients were dropped; this is a bug of the split backward")
