"""The compiled split: a torch.compile backend whose regions' backward runs as two graphs (I, W).

A region compiled by torch.compile is one autograd node whose backward is one AOT graph: run at I, it computes the
weight gradients too, which the engine then drops. `SplitBackend` compiles the same region with the backward
graph cut in two: the *I graph* computes the gradients of the region's non-parameter inputs (and the boundary
values the weight gradients need), the *W graph* the parameters' gradients from those. Which one a run of the node
executes is the node's mark (`mode`, set by `graph.stage_backward_input` before its I; the node object is what the
engine runs, on any thread): INPUTS runs the I graph and keeps what W needs on the node, the node's next run then
runs the W graph; unmarked, a run is a full backward (both graphs). Nothing is computed twice, and nothing of the
AOT graph is donated (`donated_buffer` off when compiling), so a retained graph stays valid. Regions whose inputs
are tensor subclasses (DTensor parameters under tensor parallelism) are cut alike (`flat_inputs`).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from duplexpipe.runtime.backward import compat
from duplexpipe.runtime.backward.mode import SPLITS_BACKWARD, BackwardMode, take_mode

LOG = logging.getLogger("duplexpipe.compile")
STASH = "_duplexpipe_stash"
"""What a region's I left on its node for its W."""
SPLIT_BACKENDS = ("inductor", "aot_eager")
"""torch.compile backends `SplitBackend` can split (other backends' regions keep one backward graph)."""

Runner = Callable[[list[Any]], Sequence[Any]]
"""A compiled graph in the boxed calling convention: takes its argument list (and may clear it)."""


# ---------------------------------------------------------------------------------------------- the graph cut
@dataclass
class SplitGraphs:
    """A backward graph cut in two. The I graph takes the backward's arguments and returns the non-parameter
    gradients, then the `boundary` values the W graph needs; the W graph takes the arguments listed in
    `w_args` (indices into the backward's), then the boundary values, and returns the parameters' gradients."""

    i_graph: fx.GraphModule
    w_graph: fx.GraphModule | None
    w_args: list[int]
    boundary: int
    is_param: list[bool]


def _ancestors(roots: Sequence[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _subgraph(source: fx.GraphModule, keep: set[fx.Node], inputs: Sequence[fx.Node],
              outputs: Sequence[Any]) -> fx.GraphModule:
    """A graph of the `keep` nodes of `source` (in their order) taking `inputs` and returning `outputs`."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in source.graph.nodes:
        if node in keep and node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    return fx.GraphModule(source, graph)


def split_graph(gm: fx.GraphModule, is_param: Sequence[bool]) -> SplitGraphs:
    """Cut the backward graph `gm` (one output per forward input, `is_param` says which inputs are
    parameters) into an I graph and a W graph (`SplitGraphs`). Nothing runs in both."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    if len(outs) != len(is_param):
        raise ValueError(f"backward graph has {len(outs)} outputs for {len(is_param)} forward inputs")
    i_outs = [o for o, p in zip(outs, is_param, strict=True) if not p]
    w_outs = [o for o, p in zip(outs, is_param, strict=True) if p]
    i_nodes = _ancestors(i_outs)
    w_nodes = _ancestors(w_outs)
    for node in w_nodes - i_nodes:  # an element of a tuple the I graph computes anyway: take it there
        if node.target is operator.getitem and node.args[0] in i_nodes:
            i_nodes.add(node)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    w_only = w_nodes - i_nodes
    boundary = [n for n in gm.graph.nodes if n in i_nodes and n.op != "placeholder"
                and (n in w_outs or any(user in w_only for user in n.users))]
    i_graph = _subgraph(gm, i_nodes, placeholders, i_outs + boundary)
    if not any(isinstance(o, fx.Node) for o in w_outs):
        return SplitGraphs(i_graph, None, [], len(boundary), list(is_param))
    w_inputs = [p for p in placeholders if p in w_nodes]
    w_graph = _subgraph(gm, w_only | set(w_inputs), w_inputs + boundary, w_outs)
    return SplitGraphs(i_graph, w_graph, [placeholders.index(p) for p in w_inputs], len(boundary),
                       list(is_param))


def boundary_examples(graphs: SplitGraphs) -> list[Any]:
    """Example values (the fake tensors tracing left in the nodes' meta) of the boundary values."""
    if not graphs.boundary:
        return []
    output = next(n for n in graphs.i_graph.graph.nodes if n.op == "output")
    return [n.meta.get("val") for n in list(output.args[0])[-graphs.boundary:]]


# ------------------------------------------------------------------------------------------------- the runner
class SplitBackward:
    """A region's compiled backward as two graphs; which runs is read from the mark of the node being run."""

    def __init__(self, graphs: SplitGraphs, run_i: Runner, run_w: Runner | None,
                 fillers: Sequence[Filler | None] = ()) -> None:
        self.is_param = graphs.is_param
        self.fillers = list(fillers) or [None] * len(self.is_param)
        """Per output: the local tensor to stand for a gradient another graph computes, where None cannot (a
        DTensor's, rebuilt from it by AOT's wrapper)."""
        self.w_args = graphs.w_args
        self.run_i = run_i
        self.run_w = run_w
        self.inputs = sum(not p for p in self.is_param)
        self._boxed_call = True  # AOT hands over its argument list (copied by its wrappers as an attribute)
        setattr(self, SPLITS_BACKWARD, True)

    def _assemble(self, input_grads: Sequence[Any] | None, weight_grads: Sequence[Any] | None) -> list[Any]:
        """The backward's outputs: the gradients given, and where another graph computes them None, or zeros where
        AOT's wrapper needs a tensor (the engine drops them: nothing asked for them in this run)."""
        inputs = iter(input_grads if input_grads is not None else [None] * self.inputs)
        weights = iter(weight_grads if weight_grads is not None else [None] * (len(self.is_param) - self.inputs))
        out = [next(weights) if p else next(inputs) for p in self.is_param]
        return [torch.zeros(f.shape, dtype=f.dtype, device=f.device) if g is None and f is not None else g
                for g, f in zip(out, self.fillers, strict=True)]

    def _input_part(self, args: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        """Run the I graph: (the input gradients, the boundary values, the W graph's own arguments)."""
        own = [args[i] for i in self.w_args]
        out = list(self.run_i(args))
        return out[:self.inputs], out[self.inputs:], own

    def _weight_part(self, own: list[Any], boundary: list[Any]) -> list[Any] | None:
        return None if self.run_w is None else list(self.run_w(own + boundary))

    def _unconsumed(self, node: Any, input_grads: list[Any]) -> list[Any]:
        """The input gradients this I did not hand to a node it runs (None for the others): those W hands out
        again, towards parameters off the input path. All of them when the node's edges do not line up with the
        graph's outputs."""
        edges = node.next_functions
        if len(edges) != len(self.is_param):
            return input_grads
        kept = []
        targets = (edge for edge, is_param in zip(edges, self.is_param, strict=True) if not is_param)
        for grad, (target, _) in zip(input_grads, targets, strict=True):
            leaf = target is None or hasattr(target, "variable")  # AccumulateGrad: a leaf (I captured it)
            kept.append(None if leaf or compat.will_engine_execute(target) else grad)
        return kept

    def __call__(self, args: list[Any]) -> list[Any]:
        node = compat.current_autograd_node()
        mode = take_mode(node) if node is not None else BackwardMode.ALL
        if mode is BackwardMode.WEIGHTS:
            input_grads, boundary = getattr(node, STASH)
            delattr(node, STASH)
            own = [args[i] for i in self.w_args]
            args.clear()
            return self._assemble(input_grads, self._weight_part(own, boundary))
        input_grads, boundary, own = self._input_part(args)
        args.clear()
        if mode is BackwardMode.INPUTS:  # W later: keep what it needs on the node (the gradients of inputs
            # off the input path lead to parameters that W computes: handed out again then)
            setattr(node, STASH, (self._unconsumed(node, input_grads), boundary))
            return self._assemble(input_grads, None)
        return self._assemble(input_grads, self._weight_part(own, boundary))


# ------------------------------------------------------------------------------------------------ the backend
@dataclass(frozen=True)
class Filler:
    """A local tensor's shape, dtype and device (see `SplitBackward.fillers`)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


FlatInputs = tuple[list[bool], list[Filler | None]]
"""Per input of a region's AOT graphs: whether it comes from a parameter, and its Filler (or None)."""


def flat_inputs(example_inputs: Sequence[Any]) -> FlatInputs:
    """Per input of the region's AOT graphs: whether it comes from a parameter, and its Filler when it is a
    tensor inside a tensor subclass (AOT flattens a DTensor into its local tensor and its mesh, in order)."""
    leaves, owners = compat.flatten_subclasses(example_inputs)
    is_param = [isinstance(example_inputs[k], nn.Parameter) for k in owners]
    fillers = [Filler(leaf.shape, leaf.dtype, leaf.device)
               if isinstance(leaf, torch.Tensor) and compat.is_wrapper_subclass(example_inputs[k]) else None
               for leaf, k in zip(leaves, owners, strict=True)]
    return is_param, fillers


def _splitting(inputs: FlatInputs,
               compile_graph: Callable[[fx.GraphModule, list[Any], Any], Runner]) -> Callable:
    """A backward compiler: cut the graph, compile both parts with `compile_graph(graph, examples, static)`.
    `inputs`: `flat_inputs` of the region."""
    is_param, fillers = inputs

    def compile_backward(gm: fx.GraphModule, examples: Sequence[Any], **kwargs: Any) -> Any:
        static = list(kwargs.get("static_input_idxs", ()))
        try:
            graphs = split_graph(gm, is_param)
        except ValueError as exc:  # inputs flattened differently (a tensor subclass): one graph
            LOG.warning("a compiled region's backward stays one graph (%s): its weight gradients are computed at I",
                        exc)
            return compile_graph(gm, list(examples), static)
        run_i = compile_graph(graphs.i_graph, list(examples), static)
        run_w = None
        if graphs.w_graph is not None:
            w_static = [k for k, i in enumerate(graphs.w_args) if i in static]
            w_examples = [examples[i] for i in graphs.w_args] + boundary_examples(graphs)
            run_w = compile_graph(graphs.w_graph, w_examples, w_static)
        return SplitBackward(graphs, run_i, run_w, fillers)
    return compile_backward


class SplitBackend:
    """A torch.compile backend ("inductor" with its mode and options, or "aot_eager") whose regions' backward
    runs as an I graph and a W graph (see the module docstring)."""

    def __init__(self, base: str, mode: str | None = None, options: dict[str, Any] | None = None,
                 dynamic: bool | None = None) -> None:
        if base not in SPLIT_BACKENDS:
            raise ValueError(f"SplitBackend: backend must be one of {SPLIT_BACKENDS}, got {base!r}")
        self.base = base
        self.inductor_config: dict[str, Any] = {}
        if base == "inductor":
            self.inductor_config = compat.inductor_settings(mode, options, dynamic)
        elif mode is not None or options:
            raise ValueError(f"SplitBackend: mode and options are inductor's, not {base!r}'s")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SplitBackend) and (self.base, self.inductor_config) == (
            other.base, other.inductor_config)

    def __hash__(self) -> int:
        return hash((self.base, tuple(sorted(self.inductor_config))))

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        inputs = flat_inputs(example_inputs)
        # no donated buffers (the W graph reads what the I graph's inputs were); the backward compiled with the
        # forward (the runtime asks a node's kind before its first backward); no AOT cache entry (it would hold
        # an unsplit backward; inductor's own graph cache still serves both parts across restarts)
        with compat.split_compile_settings():
            if self.base == "aot_eager":
                return self._aot_eager(gm, list(example_inputs), inputs)
            return self._inductor(gm, list(example_inputs), inputs)

    @staticmethod
    def _aot_eager(gm: fx.GraphModule, example_inputs: list[Any], inputs: FlatInputs) -> Any:
        def compile_graph(graph: fx.GraphModule, examples: list[Any], static: list[int]) -> Runner:
            runner: Runner = compat.boxed_nop(graph, examples)
            return runner

        return compat.aot_eager(gm, example_inputs, bw_compiler=_splitting(inputs, compile_graph))

    def _inductor(self, gm: fx.GraphModule, example_inputs: list[Any], inputs: FlatInputs) -> Any:
        def compile_graph(graph: fx.GraphModule, examples: list[Any], static: list[int]) -> Runner:
            runner: Runner = compat.inductor_compile_graph(graph, examples, static_input_idxs=static,
                                                           is_backward=True)
            return runner

        split = _splitting(inputs, compile_graph)

        def inner(graph: fx.GraphModule, examples: Sequence[Any], **kwargs: Any) -> Any:
            if kwargs.get("is_backward"):
                return split(graph, examples, **kwargs)
            return compat.inductor_compile_graph(graph, examples, **kwargs)

        return compat.inductor(gm, example_inputs, inner, self.inductor_config)
