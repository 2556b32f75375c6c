"""Split any nn.Module into model parts by tracing it (torch.distributed.pipelining's frontend)."""

from __future__ import annotations

import contextlib
import itertools
import operator
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map_only, tree_unflatten

from duplexpipe.model.split import uniform_balance

SplitPoints = str | Sequence[str] | Mapping[str, str] | None
"""Where to cut: None (the forward calls `pipe_split()`), module names to cut before, a mapping
name -> "before" | "after", or the name of a ModuleList/Sequential whose children are spread
uniformly over `num_parts` parts."""

_SUBMOD_PREFIX = "submod_pp_"
_WHERE = ("before", "after")


class GraphPart(nn.Module):
    """One traced model part: runs its piece of the graph and hands on everything later parts need.

    Inputs: part 0 takes the model's inputs (positional, or keyword by the forward's parameter
    names); part k > 0 takes the values part k-1 returned, positionally. Outputs: the values that
    later parts use, as a tuple (one value: the tensor itself); the last part returns the model's
    output with its original structure (a tensor, tuple or dict).
    """

    def __init__(self, index: int, body: nn.Module, inputs: tuple[str, ...],
                 steps: tuple[tuple[str, str, tuple[str, ...], int], ...], outputs: tuple[str, ...],
                 out_spec: TreeSpec | None, traced_on: torch.device | None = None) -> None:
        super().__init__()
        self.index = index
        """The part's position in the model (0 first)."""
        self.body = body
        """torch's traced stage module (a GraphModule holding this part's parameters)."""
        self.inputs = inputs
        """Names of the values this part takes, in order (part 0: the forward's parameters)."""
        self.steps = steps
        """("call", name, inputs, 0) runs `body`; ("item", name, (tuple_name,), i) takes element i."""
        self.outputs = outputs
        """Names of the values this part returns, in order."""
        self.out_spec = out_spec
        """The model output's structure (last part only; None elsewhere)."""
        self.made_on = traced_on
        """The device the graph makes its tensors on (the model's at tracing, tensors made without `device=`
        included); moving the part's parameters (`.to`, `.to_empty`) moves it along."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        env = self._bind(args, kwargs)
        for kind, name, sources, item in self.steps:
            if kind == "call":
                env[name] = self.body(*(env[s] for s in sources))
            else:
                env[name] = env[sources[0]][item]
        given = set(self.inputs)
        values = [_pass_on(env[n]) if n in given else env[n] for n in self.outputs]
        if self.out_spec is not None:
            return tree_unflatten(values, self.out_spec)
        return values[0] if len(values) == 1 else tuple(values)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > len(self.inputs):
            raise TypeError(f"model part {self.index} takes {len(self.inputs)} inputs {list(self.inputs)}, "
                            f"got {len(args)} positional values")
        env = dict(zip(self.inputs, args, strict=False))
        for key, value in kwargs.items():
            if key not in self.inputs or key in env:
                raise TypeError(f"model part {self.index}: unexpected or repeated input {key!r}; "
                                f"inputs are {list(self.inputs)}")
            env[key] = value
        missing = [n for n in self.inputs if n not in env]
        if missing:
            raise TypeError(f"model part {self.index} is missing inputs {missing} (inputs: {list(self.inputs)})")
        return env

    def _apply(self, fn: Any, recurse: bool = True) -> GraphPart:
        out = super()._apply(fn, recurse)
        held = next(itertools.chain(self.parameters(), self.buffers()), None)
        if held is not None and self.made_on is not None and held.device != self.made_on:
            retarget_factories(self.body, self.made_on, held.device)
            self.made_on = held.device
        return out  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"index={self.index}, inputs={list(self.inputs)}, outputs={list(self.outputs)}"


def retarget_factories(body: nn.Module, old: torch.device, new: torch.device) -> None:
    """Make the graph's tensor-making calls that tracing pinned to `old` (device=...) make them on `new`."""
    for module in body.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        changed = False
        for node in graph.nodes:
            device = node.kwargs.get("device")
            if isinstance(device, torch.device) and device == old:
                node.kwargs = {**node.kwargs, "device": new}
                changed = True
        if changed and isinstance(module, fx.GraphModule):
            module.recompile()
        elif changed and callable(finalize := getattr(module, "finalize", None)):  # torch.export's
            finalize()  # InterpreterModule: its GraphModule is built from the graph


def _pass_on(value: Any) -> Any:
    """A value this part only hands on: a view, so every output tensor has its own autograd node."""
    return value.view_as(value) if isinstance(value, Tensor) else value


def split_module(
    model: nn.Module,
    sample_args: tuple[Any, ...] = (),
    sample_kwargs: dict[str, Any] | None = None,
    *,
    split_points: SplitPoints = None,
    num_parts: int | None = None,
) -> list[GraphPart]:
    """Cut `model` into parts at `split_points` by tracing its forward on one sample microbatch.

    `sample_args`/`sample_kwargs` are the forward's inputs shaped like one training microbatch
    (tracing specialises shapes). A model on the meta device is traced on meta inputs and gives
    meta parts (fill them with `Pipeline(parts, ..., init=...)`); tensors the forward makes (a causal mask
    from `torch.ones(T, T).tril()`, with or without `device=`) follow the parts when their parameters move
    (`.to`, `.to_empty`). Parameters stay shared with
    `model`; one used in several parts (tied weights) becomes an independent copy in each.
    """
    kwargs = dict(sample_kwargs or {})
    spec = resolve_split_points(model, split_points, num_parts)
    held = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = held.device if held is not None else torch.device("cpu")
    if device.type == "meta":
        sample_args, kwargs = tree_map_only(Tensor, lambda t: t.to("meta"), (tuple(sample_args), kwargs))
    out_spec = output_spec(model, sample_args, kwargs)
    with torch.device("meta") if device.type == "meta" else contextlib.nullcontext():  # tensors made
        pipe = _trace(model, sample_args, kwargs, spec)  # without device= join the meta ones
    parts = parts_from_graph(pipe.split_gm, out_spec, device)
    expected = len(spec) + 1 if spec else None
    if expected is not None and len(parts) != expected:
        raise ValueError(f"split points {sorted(spec)} should give {expected} parts, tracing gave {len(parts)} "
                         "(a cut before the first or after the last operation leaves a part empty)")
    return parts


def resolve_split_points(model: nn.Module, points: SplitPoints, num_parts: int | None) -> dict[str, str]:
    """{module name: "before" | "after"} for `points` (see SplitPoints), checked against `model`."""
    names = dict(model.named_modules())
    if points is None:
        return {}
    if isinstance(points, str):
        container = names.get(points)
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"split_points {points!r} must name a ModuleList or Sequential of {type(model).__name__}")
        if num_parts is None:
            raise ValueError(f"split_points {points!r} (a container) needs num_parts")
        counts = uniform_balance(len(container), num_parts)
        starts = itertools.accumulate(counts[:-1])
        return {f"{points}.{i}": "before" for i in starts}
    items = points.items() if isinstance(points, Mapping) else ((name, "before") for name in points)
    spec: dict[str, str] = {}
    for name, where in items:
        if name not in names or not name:
            raise ValueError(f"split point {name!r} names no submodule of {type(model).__name__}")
        if where not in _WHERE:
            raise ValueError(f"split point {name!r}: {where!r} must be 'before' or 'after'")
        spec[name] = where
    return spec


def output_spec(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TreeSpec:
    """The structure of the model's output, found by running forward on the meta device (no compute); a
    tensor the forward makes without `device=` (e.g. `torch.ones(T, T).tril()`, a causal mask) is made
    there too."""
    state = {n: t.to("meta") for n, t in itertools.chain(model.named_parameters(), model.named_buffers())}
    meta_args, meta_kwargs = tree_map_only(Tensor, lambda t: t.to("meta"), (args, kwargs))
    with torch.no_grad(), torch.device("meta"):
        out = torch.func.functional_call(model, state, meta_args, meta_kwargs)
    return tree_flatten(out)[1]


def _trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], spec: dict[str, str]) -> Any:
    """torch.distributed.pipelining.pipeline(...), leaving the model's forwards as they were."""
    from torch.distributed.pipelining import SplitPoint, pipeline  # heavy: imported when splitting

    split_spec = {name: SplitPoint.BEGINNING if where == "before" else SplitPoint.END for name, where in spec.items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations
            return pipeline(model, args, kwargs or None, split_spec=split_spec or None)
    except RuntimeError as exc:
        raise ValueError(f"cannot trace {type(model).__name__} to split it: {exc} ({exc.__cause__})") from exc
    finally:
        for name in spec:
            module = model.get_submodule(name)
            module.__dict__.pop("forward", None)  # annotate_split_points patched these in place
            module.__dict__.pop("_orig_forward", None)


def parts_from_graph(root: fx.GraphModule, out_spec: TreeSpec,
                     traced_on: torch.device | None = None) -> list[GraphPart]:
    """One GraphPart per stage module of torch's split graph, each handing on what later parts need
    (`traced_on`: the model's device at tracing, see GraphPart.made_on)."""
    stage_of: dict[str, int] = {}
    order: dict[str, int] = {}
    nodes: list[fx.Node] = []
    leaves: list[str] = []
    for node in root.graph.nodes:
        if node.op == "placeholder":
            stage_of[node.name] = -1
        elif node.op == "call_module" and str(node.target).startswith(_SUBMOD_PREFIX):
            stage_of[node.name] = order.setdefault(str(node.target), len(order))
        elif node.op == "call_function" and node.target is operator.getitem:
            stage_of[node.name] = stage_of[_source(node.args[0])]
        elif node.op == "output":
            leaves = [n.name for n in tree_flatten(node.args[0])[0]]
            continue
        else:
            raise ValueError(f"unexpected node {node.format_node()} between the traced parts")
        nodes.append(node)
    last = len(order) - 1
    if last < 0 or len(leaves) != out_spec.num_leaves:
        raise ValueError(f"tracing gave {len(order)} parts and {len(leaves)} outputs for {out_spec.num_leaves} "
                         "output tensors")

    def live_after(k: int) -> tuple[str, ...]:
        return tuple(n.name for n in nodes if stage_of[n.name] <= k and any(
            u.op == "output" or stage_of.get(u.name, last + 1) > k for u in n.users))

    parts = []
    for target, k in order.items():
        steps = tuple(_step(n) for n in nodes if stage_of[n.name] == k and n.op != "placeholder")
        inputs = live_after(k - 1) if k else tuple(n for n, s in stage_of.items() if s < 0)
        outputs = tuple(leaves) if k == last else live_after(k)
        parts.append(GraphPart(k, getattr(root, target), inputs, steps, outputs, out_spec if k == last else None,
                               traced_on))
    return parts


def _source(arg: Any) -> str:
    """The name of the graph value `arg` (an fx.Node); ValueError for constants between parts."""
    if not isinstance(arg, fx.Node):
        raise ValueError(f"a traced part takes the constant {arg!r} as an input; only tensors may flow between parts")
    return arg.name


def _step(node: fx.Node) -> tuple[str, str, tuple[str, ...], int]:
    """A part's step: ("call", name, input names, 0) for its stage module, ("item", name, (tuple,), i)."""
    if node.op == "call_module":
        return "call", node.name, tuple(_source(a) for a in node.args), 0
    index = node.args[1]
    if not isinstance(index, int):
        raise ValueError(f"unexpected index {index!r} in {node.format_node()}")
    return "item", node.name, (_source(node.args[0]),), index
