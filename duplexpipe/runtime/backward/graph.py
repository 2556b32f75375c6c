"""The split of a stage's backward graph: input gradients now (I, `stage_backward_input`), weight gradients later
(W, `stage_backward_weight`), in torch's words.

Works on any autograd graph (plain nn.Linear, LayerNorm, attention; no custom autograd functions needed). The
idea is torch.distributed.pipelining's stage_backward_input / stage_backward_weight, implemented here
independently:

* the *input path* is every graph node from which the stage input is reachable;
* a parameter's *intermediates* are the input-path nodes (or graph roots off that path) where its gradient branch
  leaves the input path (a Linear's addmm node, a LayerNorm node); parameters sharing intermediates form one
  *param group*;
* I computes d(input) only, with pre-hooks on the intermediates recording the gradient each receives; autograd
  then skips every weight branch, so no weight gradient is computed;
* W restarts autograd at the intermediates with the recorded gradients and asks only for the parameters: the
  engine runs each intermediate once more for its weight outputs and the weight-only branches below it. It never
  re-runs the input path (except where one param group meets it at several intermediates, e.g. a weight tied
  across layers of one stage; there the recorded gradients are pinned so nothing is counted twice).
* a stage whose inputs take no gradient (a first stage) has nothing to do at I: its graph is not analysed and W
  runs its full backward, once (torch's pipelining does the same).

The analysis walks each microbatch's graph once; the parameters' gradient accumulators are read off that walk
(never looked up per parameter: under tensor parallelism each lookup is a DTensor operator dispatch). Nothing of it
is cached across microbatches: every forward builds new nodes, a leaf's accumulator may be replaced between two
forwards (a dtype or device change), and a compiled region's kind changes once its backward is compiled.

Nodes that compute their weight gradients in their own backward (`mode.NodeKind`: a region compiled by
`compiled.SplitBackend`, an autograd Function such as `moe.linear`'s) are marked INPUTS before I (`mode`): their
run then computes only the input gradients, and W restarts at them like at any intermediate. A region compiled
otherwise (UNSPLIT_REGION) can only run its one backward graph, once: the param groups that meet the input path at
one are computed at I (their parameters join the I's `autograd.grad`) and their gradients handed to W, which
accumulates them; nothing is recomputed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from duplexpipe.runtime.backward import compat
from duplexpipe.runtime.backward.checkpoint import saved_again
from duplexpipe.runtime.backward.mode import BackwardMode, NodeKind, mode_of, node_kind, set_mode

Edge = GradientEdge
SPLITS = (NodeKind.SPLIT_FUNCTION, NodeKind.SPLIT_REGION)
"""Nodes that read their mark: marked INPUTS before I."""
COMPILED = (NodeKind.SPLIT_REGION, NodeKind.UNSPLIT_REGION)
"""Compiled regions: an engine call that retains the graph runs them without donated buffers."""


@dataclass
class ParamGroup:
    """Parameters whose gradient branches leave the input path at the same intermediates."""

    params: list[Tensor] = field(default_factory=list)
    intermediates: set[Node] = field(default_factory=set)


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
    accumulator = compat.ACCUMULATE_GRAD
    return {id(node.variable): node for node in parents if type(node) is accumulator}  # type: ignore[attr-defined]


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


def _intermediates(start: Node, parents: dict[Node, list[Node]], input_path: set[Node],
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


def _param_groups(params: Sequence[Tensor], parents: dict[Node, list[Node]], input_path: set[Node],
                  roots: set[Node], leaves: dict[int, Node]) -> list[ParamGroup]:
    """Partition the used parameters into param groups with disjoint intermediates."""
    groups: list[ParamGroup | None] = []
    owner: dict[Node, int] = {}
    for param in params:
        node = leaves.get(id(param)) if param.grad_fn is None else param.grad_fn
        points = _intermediates(node, parents, input_path, roots) if node is not None else set()
        if not points:
            continue  # not used by this stage's graph
        merged = ParamGroup([param], set(points))
        for index in sorted({owner[n] for n in points if n in owner}):
            old = groups[index]
            if old is not None:
                merged.params = old.params + merged.params
                merged.intermediates |= old.intermediates
                groups[index] = None
        groups.append(merged)
        for node in merged.intermediates:
            owner[node] = len(groups) - 1
    return [g for g in groups if g is not None]


class ParamGroups:
    """What I leaves for W: the param groups, the gradients recorded at their intermediates, and the gradients I
    already computed (`stage_backward_weight` accumulates them all, once)."""

    def __init__(self, groups: list[ParamGroup], grads: dict[Node, tuple[Tensor | None, ...]],
                 root_grads: dict[Node, list[tuple[Edge, Tensor]]], at_input: list[tuple[Tensor, Tensor | None]],
                 compiled: bool = False, full: bool = False) -> None:
        self.groups = groups
        self.grads = grads
        """The gradients each intermediate received at I."""
        self.root_grads = root_grads
        """The gradients of the roots off the input path (I did not run them)."""
        self.at_input = at_input
        """(parameter, gradient) computed at I: its group met the input path in an unsplit compiled region."""
        self.compiled = compiled
        """Whether compiled regions may run at W (the engine call then lifts AOT's donated-buffer refusal)."""
        self.full = full
        """W is the stage's full backward (nothing ran at I): one engine call that frees the graph as it goes."""
        self.done = False
        self.computed_at_input = len(at_input)
        """How many parameters' gradients I computed (their groups met the input path in an unsplit region)."""

    def edges(self, group: ParamGroup) -> tuple[list[Edge], list[Tensor]]:
        """Where W restarts for `group`: its intermediates' recorded gradients and its roots'."""
        edges: list[Edge] = []
        grads: list[Tensor] = []
        for node in group.intermediates:
            if node in self.root_grads:
                for edge, root_grad in self.root_grads[node]:
                    edges.append(edge)
                    grads.append(root_grad)
            for nr, grad in enumerate(self.grads.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, nr))
                    grads.append(grad)
        return edges, grads


def stage_backward_weight(param_groups: ParamGroups) -> None:
    """W: compute and accumulate (into .grad) the gradients of every parameter of `param_groups`, once."""
    if param_groups.done:
        raise RuntimeError("this stage's weight gradients have already been computed")
    param_groups.done = True
    if param_groups.at_input:
        accumulate([p for p, _ in param_groups.at_input], [g for _, g in param_groups.at_input])
    if param_groups.full:
        _full_backward(param_groups)
    else:
        with compat.without_donated_buffers() if param_groups.compiled else contextlib.nullcontext():
            _weight_backward(param_groups)
    param_groups.groups, param_groups.grads, param_groups.root_grads, param_groups.at_input = [], {}, {}, []


def _full_backward(param_groups: ParamGroups) -> None:
    """The full backward from the roots, once (no graph kept: nothing runs on it after W): B's engine call, each
    gradient added into .grad as soon as it is formed (collecting them all and adding them after the call held them
    all at once and read each back from memory: on CPU a first stage's W cost more than its B). Where a parameter is
    not a leaf (the engine would run its grad_fn too, for nothing), its gradients are taken from the engine and
    accumulated here."""
    (group,) = param_groups.groups
    pairs = param_groups.root_grads.values()
    edges = [edge for pair in pairs for edge, _ in pair]
    grads = [grad for pair in pairs for _, grad in pair]
    if all(param.grad_fn is None for param in group.params):
        compat.run_engine(edges, grads, group.params, retain_graph=False, accumulate=True)
        return
    accumulate(group.params, compat.run_engine(edges, grads, group.params, retain_graph=False, accumulate=False))


def _weight_backward(param_groups: ParamGroups) -> None:
    """Each param group's gradients, restarting the engine at its intermediates."""
    for group in param_groups.groups:
        edges, grads = param_groups.edges(group)
        if not edges:
            continue
        handles = []
        if len(group.intermediates) > 1:  # pin recorded gradients: no double counting
            for node in group.intermediates:
                if node in param_groups.grads:
                    saved = param_groups.grads[node]
                    handles.append(node.register_prehook(lambda _grads, saved=saved: saved))
        try:
            weight_grads = compat.run_engine(edges, grads, group.params, retain_graph=True, accumulate=False)
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


def stage_backward_input(roots: Sequence[Edge], grads: Sequence[Tensor], inputs: Sequence[Tensor],
                         params: Sequence[Tensor]) -> tuple[list[Tensor | None], ParamGroups]:
    """I: gradients of `inputs` only, plus the ParamGroups from which `stage_backward_weight` later computes the
    weight gradients.

    `roots` are the gradient edges of the stage outputs (or of the loss), `grads` the
    gradients flowing into them; `inputs` are the stage's input leaves (those that do not
    require grad get None); `params` the parameters that should receive gradients.
    """
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted:
        return [None] * len(inputs), _full_backward_later(roots, grads, params)
    root_nodes = list(dict.fromkeys(edge.node for edge in roots))
    parents = _parents(root_nodes)
    leaves = _leaves(parents)
    input_path = _ancestors([leaves[id(t)] for t in wanted if id(t) in leaves], parents)
    root_set = set(root_nodes)
    groups = _param_groups([p for p in params if p.requires_grad], parents, input_path, root_set, leaves)
    kinds = {node: node_kind(node) for node in parents}
    now, later = _when_computed(groups, input_path, kinds)
    root_grads: dict[Node, list[tuple[Edge, Tensor]]] = {}
    for edge, grad in zip(roots, grads, strict=True):
        if edge.node not in input_path:
            root_grads.setdefault(edge.node, []).append((edge, grad))
    recorded: dict[Node, tuple[Tensor | None, ...]] = {}

    def recorder(node: Node) -> Any:
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            recorded[node] = tuple(grad_outputs)
        return hook

    on_input = {node for group in later for node in group.intermediates if node in input_path}
    split = {node for node in on_input if kinds[node] in SPLITS}
    split -= {node for group in now for node in group.intermediates}  # a region computing a group at I runs B
    early = [p for group in now for p in group.params]
    hooks = [node.register_prehook(recorder(node)) for node in on_input]
    on_path = [t for t in wanted if leaves.get(id(t)) in input_path]
    found: Sequence[Tensor | None] = ()
    compiled = any(kind in COMPILED for kind in kinds.values())
    try:
        for node in split:
            set_mode(node, BackwardMode.INPUTS)
        if on_path:
            with compat.without_donated_buffers() if compiled else contextlib.nullcontext(), saved_again(on_input):
                found = compat.run_engine(roots, grads, on_path + early, retain_graph=True, accumulate=False)
    finally:
        for handle in hooks:
            handle.remove()
        _check_split(split, recorded)
    by_id = {id(t): g for t, g in zip(on_path, found, strict=False)} if on_path else {}
    dinputs = [by_id.get(id(t)) if t.requires_grad else None for t in inputs]
    at_input = list(zip(early, found[len(on_path):], strict=True)) if found else []
    return dinputs, ParamGroups(later, recorded, root_grads, at_input, compiled)


def _full_backward_later(roots: Sequence[Edge], grads: Sequence[Tensor], params: Sequence[Tensor]) -> ParamGroups:
    """A stage whose inputs take no gradient (a first stage): I has nothing to compute, so the graph is not analysed
    at all and W runs the full backward, once (torch's pipelining does the same on its first stage)."""
    root_grads: dict[Node, list[tuple[Edge, Tensor]]] = {}
    for edge, grad in zip(roots, grads, strict=True):
        root_grads.setdefault(edge.node, []).append((edge, grad))
    used = [p for p in params if p.requires_grad]
    groups = [ParamGroup(used, set(root_grads))] if used else []
    return ParamGroups(groups, {}, root_grads, [], full=bool(used))


def _when_computed(groups: list[ParamGroup], input_path: set[Node],
                   kinds: dict[Node, NodeKind]) -> tuple[list[ParamGroup], list[ParamGroup]]:
    """(groups computed at I, groups deferred to W): a group meeting the input path in an unsplit compiled region
    is computed at I (that region runs its one backward graph, once, at I)."""
    now: list[ParamGroup] = []
    later: list[ParamGroup] = []
    for group in groups:
        unsplit = any(kinds.get(n) is NodeKind.UNSPLIT_REGION for n in group.intermediates if n in input_path)
        (now if unsplit else later).append(group)
    return now, later


def _check_split(split: set[Node], recorded: dict[Node, tuple[Tensor | None, ...]]) -> None:
    """After I: every marked node that ran computed only its input gradients (its mark now says W); one that did not
    run is unmarked. One that ran a full backward would have dropped its weight gradients: refuse, never train on
    that."""
    for node in split:
        if mode_of(node) is BackwardMode.INPUTS:
            set_mode(node, BackwardMode.ALL)
            if node in recorded:
                raise RuntimeError(f"a node ({node.name()}) ran its full backward at I, so its weight gradients "
                                   "were dropped; this is a bug of the split backward")
