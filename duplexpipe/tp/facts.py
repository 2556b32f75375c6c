"""What a tensor-parallel plan does to each model part, for the planner (`planner.profile.TPFacts`): the collectives
a TP rank issues, measured from the activations of one forward of the whole parts, the parameters left whole, and
the degrees the plan can shard the model with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from duplexpipe.planner.profile import TP_DEGREES_CHECKED, TPFacts
from duplexpipe.runtime.structure import call, flatten
from duplexpipe.tp.plans import CheckedPlan, TPPlan, first_layout, plan_errors, resolve


@runtime_checkable
class StyledPlan(Protocol):
    """A callable plan that can say which torch style it gives each module of a part (`HFTensorPlan`)."""

    def styles(self, part: nn.Module) -> Mapping[str, ParallelStyle]:
        """{module path: style} of `part`, as `parallelize_module` would apply them."""


def part_styles(part: nn.Module, plan: TPPlan) -> dict[str, ParallelStyle] | None:
    """{module path: style} the plan applies to `part`; None for a callable plan that cannot say."""
    if isinstance(plan, Mapping):
        return {path: style for key, style in plan.items() for path, _ in resolve(part, key)}
    if isinstance(plan, StyledPlan):
        return dict(plan.styles(part))
    return None


def tp_degrees(parts: Sequence[nn.Module], plan: TPPlan) -> tuple[int, ...]:
    """The degrees 2 to `TP_DEGREES_CHECKED` the plan can shard every part with (its own checks)."""
    out = []
    for tp in range(2, TP_DEGREES_CHECKED + 1):
        if isinstance(plan, Mapping):
            if plan_errors(parts, plan, tp)[1]:
                continue
        elif isinstance(plan, CheckedPlan):
            try:
                plan.check(parts, tp)
            except ValueError:
                continue
        out.append(tp)
    return tuple(out)


def _nbytes(value: Any) -> int:
    """Bytes of the first tensor of a module's input or output (its activation)."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)) and value:
        return _nbytes(value[0])
    return 0


class _Counter:
    """Forward hooks on the plan's sharded modules of one part, adding up the collectives they imply."""

    def __init__(self, part: nn.Module, styles: Mapping[str, ParallelStyle]) -> None:
        self.counts = [0, 0, 0, 0]  # forward collectives, forward bytes, backward collectives, backward bytes
        self.handles: list[Any] = []
        sharded: set[int] = set()
        for path, style in styles.items():
            module = part.get_submodule(path) if path else part
            if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
                continue
            weight = getattr(module, "weight", None)
            if isinstance(weight, Tensor):
                sharded.add(id(weight))
            bias = getattr(module, "bias", None)
            if isinstance(style, ColwiseParallel) and isinstance(bias, Tensor):
                sharded.add(id(bias))
            self.handles.append(module.register_forward_hook(self._hook(style, isinstance(module, nn.Embedding))))
        whole = {id(p): p for p in part.parameters()}
        self.replicated = sum(p.numel() * p.element_size() for i, p in whole.items() if i not in sharded)

    def _hook(self, style: ParallelStyle, embedding: bool) -> Any:
        def hook(_module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(style, RowwiseParallel):  # its partial output summed: all-reduce (SP: reduce-scatter)
                self.counts[0] += 1
                self.counts[1] += _nbytes(output)
                return
            assert isinstance(style, ColwiseParallel)
            if isinstance(first_layout(style.output_layouts), Replicate):  # its sharded output gathered
                self.counts[0] += 1
                self.counts[1] += _nbytes(output)
            if isinstance(first_layout(style.input_layouts), Replicate) and not embedding:  # input gradient all-reduced
                self.counts[2] += 1
                self.counts[3] += _nbytes(args)
        return hook

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()

    def facts(self) -> TPFacts:
        """What the hooks added up."""
        forward, forward_bytes, backward, backward_bytes = self.counts
        return TPFacts(forward, forward_bytes, backward, backward_bytes, self.replicated)


def tp_facts(parts: Sequence[nn.Module], sample_input: Any, plan: TPPlan) -> list[TPFacts] | None:
    """Per part, what the plan does to it on `sample_input` (one microbatch, run through the whole parts in order
    as the runtime calls stages, without gradients); None when the plan cannot say which modules it shards."""
    styles = [part_styles(part, plan) for part in parts]
    if any(s is None for s in styles):
        return None
    counters = [_Counter(part, s) for part, s in zip(parts, styles, strict=True) if s is not None]
    form, leaves = flatten(sample_input, "sample_input")
    try:
        with torch.no_grad():
            for k, part in enumerate(parts):
                form, leaves = flatten(call(part, form, leaves, f"part {k}"), f"the output of part {k}")
    finally:
        for counter in counters:
            counter.close()
    return [c.facts() for c in counters]
