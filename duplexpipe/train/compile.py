"""Compiled stages: which blocks of a stage torch.compile compiles (in place), with which backend, and the log of
what compiled when (the first step, a recompilation and why).

Blocks, as torchtitan compiles them: the layers of a `from_layers` part, the blocks a part names itself
(`compile_blocks()`, e.g. a Hugging Face part's decoder layers), else the whole part. Inside a block holding MoE
layers, the pieces around them (norms, the mixer, the router) are compiled and the expert dispatch, its exchanges
and the deferrable projections (`moe.linear`) stay eager. Blocks compile in place (`nn.Module.compile`): state dict
names do not change, and the step runs after every other module transform (checkpointing wrappers, expert sharding,
data-parallel wrapping, tensor parallelism's `parallelize_module`: blocks with DTensor parameters, as torchtitan
composes them; static shapes there unless the user sets `dynamic`). Under a schedule with a split backward (I and
W), inductor and aot_eager compile through `runtime.compiled_split.SplitBackend`, whose regions' backward runs as
an I graph and a W graph; parts the user compiled are left as they are (their regions run their backward whole at
I; `runtime.autograd_split`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from duplexpipe.model.stages import inner_module
from duplexpipe.model.state_names import split_style
from duplexpipe.moe.layer import MoELayer
from duplexpipe.runtime.compiled_split import SPLIT_BACKENDS, SplitBackend
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.ir import Op, Schedule
from duplexpipe.train.compile_options import backend_name, check_usable, compile_options

LOG = logging.getLogger("duplexpipe.compile")
BLOCKS_HOOK = "compile_blocks"
"""A part may define `compile_blocks(self) -> Iterable[nn.Module]`: the submodules compiled one by one."""
MAX_REASONS = 32
"""Distinct recompilation reasons logged per pipeline (each once)."""


def user_compiled(module: nn.Module) -> bool:
    """Whether `module` or a submodule was compiled by the user (torch.compile's wrapper, or Module.compile)."""
    import torch._dynamo

    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) or m._compiled_call_impl is not None
               for m in module.modules())


def _holds_moe(module: nn.Module) -> bool:
    return any(isinstance(m, MoELayer) for m in module.modules())


def _pieces(block: nn.Module) -> list[tuple[nn.Module, bool]]:
    """(module, in an MoE block) to compile for `block`: the block itself, or around its MoE layers the pieces
    that hold none, and each MoE layer's router."""
    if not _holds_moe(block):
        return [(block, False)]
    if isinstance(block, MoELayer):
        return [(block.router, True)]
    out: list[tuple[nn.Module, bool]] = []
    for child in block.children():
        out += _pieces(child) if _holds_moe(child) else [(child, True)]
    return out


def compile_targets(stage_module: nn.Module) -> list[tuple[nn.Module, bool]]:
    """What to compile in one stage module: (module, inside an MoE block) pairs; none when the user compiled it."""
    part = inner_module(stage_module)
    if user_compiled(part):
        return []
    hook = getattr(part, BLOCKS_HOOK, None)
    if callable(hook):
        blocks = list(hook())
    elif split_style(part):
        blocks = [child for name, child in part.named_children() if name.startswith("layer")]
    else:
        blocks = [part]
    return [piece for block in blocks for piece in _pieces(block)]


def splits_backward(schedule: Schedule) -> bool:
    """Whether the schedule runs some backward as I and W."""
    return any(part.op is Op.I for actions in schedule.actions for a in actions for part in a.compute_parts())


def torch_compile_kwargs(options: Mapping[str, Any], split: bool, moe: bool) -> dict[str, Any]:
    """The keyword arguments each target is compiled with: the user's, with inductor and aot_eager turned into
    `SplitBackend` under a split backward; inside an MoE block without fullgraph (the eager pieces between)."""
    kwargs = dict(options)
    name = backend_name(options)
    if split and name in SPLIT_BACKENDS:
        kwargs["backend"] = SplitBackend(name, kwargs.pop("mode", None), kwargs.pop("options", None),
                                         kwargs.get("dynamic"))
    if moe:
        kwargs["fullgraph"] = False
    return kwargs


def static_under_dtensor(options: Mapping[str, Any], modules: Iterable[nn.Module]) -> dict[str, Any]:
    """The options, with `dynamic=False` when a module holds DTensor parameters (tensor parallelism) and the user
    did not choose: torch 2.13's AOT tracing of DTensor code with dynamic shapes can recurse without end (torch's
    own DTensor compile tests pass dynamic=False); each new batch shape then compiles once, and is logged."""
    from torch.distributed.tensor import DTensor

    if "dynamic" in options or not any(isinstance(p, DTensor) for m in modules for p in m.parameters()):
        return dict(options)
    LOG.info("tensor-parallel blocks compile with static shapes (dynamic=False): a new batch shape compiles once")
    return {**options, "dynamic": False}


class CompiledStages:
    """This rank's compiled blocks and the log of what compiles when (`watching` around each step)."""

    def __init__(self, stage_modules: Mapping[int, nn.Module], setting: bool | Mapping[str, Any] | None,
                 schedule: Schedule, device: torch.device,
                 parts: Sequence[nn.Module] | Callable[..., Any] = ()) -> None:
        """`setting`: `PipelineConfig.compile` (or torch.compile's options); `parts`: the parts given to the Pipeline
        (a factory has none to look at). Built after every other module transform of the stages."""
        self.options = compile_options(setting)
        sources = [] if callable(parts) else parts
        if any(m._compiled_call_impl is not None for part in sources for m in part.modules()):
            LOG.warning("a given part holds modules compiled in place (nn.Module.compile), which torch drops when a "
                        "stage copies its part: they run eager; use torch.compile(module) or PipelineConfig.compile")
        self.split = splits_backward(schedule)
        """Whether the schedule splits backwards (the backend then splits the compiled backward too)."""
        self.modules = 0
        """How many modules were compiled here."""
        self.user = sorted(s for s, m in stage_modules.items() if user_compiled(inner_module(m)))
        """Stages the user compiled (left as they are)."""
        if self.options is not None:
            check_usable(self.options, device, self.split)
            self.options = static_under_dtensor(self.options, stage_modules.values())
            split_kwargs = torch_compile_kwargs(self.options, self.split, moe=False)
            moe_kwargs = torch_compile_kwargs(self.options, self.split, moe=True)
            for stage in sorted(stage_modules):
                for target, in_moe in compile_targets(stage_modules[stage]):
                    target.compile(**(moe_kwargs if in_moe else split_kwargs))
                    self.modules += 1
        self._steps = 0
        self._kinds: set[str] = set()
        self._seen: set[str] = set()

    @property
    def active(self) -> bool:
        """Whether anything on this rank is compiled (by the config or by the user)."""
        return self.modules > 0 or bool(self.user)

    def describe(self) -> str:
        """One line: what is compiled and how."""
        parts = []
        if self.modules:
            backend = backend_name(self.options or {}) or "a custom backend"
            how = " (backward split into I and W graphs)" if self.split and backend in SPLIT_BACKENDS else ""
            parts.append(f"{self.modules} modules with {backend}{how}")
        if self.user:
            parts.append(f"stages {self.user} as compiled by the user")
        return "; ".join(parts)

    def patience(self, kind: str, watchdog: Watchdog, limit_s: float) -> contextlib.AbstractContextManager[None]:
        """Around the first call of `kind` ("step" or "evaluate") when anything here is compiled (it compiles,
        at each rank's own pace): every wait of `watchdog` bounded by `limit_s` (`PipelineConfig.compile_timeout_s`)
        when that is longer than its own bound; later calls keep its own bound."""
        if not self.active or kind in self._kinds:
            return contextlib.nullcontext()
        self._kinds.add(kind)
        return watchdog.patient(limit_s)

    @contextlib.contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Around a step or an evaluation: the first one logs that it compiles (and how long it took); later,
        new graphs are logged with the reasons dynamo gave (each reason once)."""
        if not self.active:
            yield
            return
        from torch._dynamo.utils import counters, guard_failures

        first = self._steps == 0
        self._steps += 1
        if first:
            LOG.info("compiling %s on the first step (inductor reuses its cache across restarts)", self.describe())
        graphs = counters["stats"]["unique_graphs"]
        known = {code: len(reasons) for code, reasons in guard_failures.items()}
        start = time.perf_counter()
        yield
        new = counters["stats"]["unique_graphs"] - graphs
        if first:
            LOG.info("%s: compiled %d graphs; the step took %.1f s", what, new, time.perf_counter() - start)
        elif new:
            reasons = [r.split(": ", 1)[-1] for code, rs in guard_failures.items() for r in rs[known.get(code, 0):]]
            fresh = [r for r in dict.fromkeys(reasons) if r not in self._seen][:MAX_REASONS - len(self._seen)]
            self._seen.update(fresh)
            if fresh or not reasons:
                LOG.info("%s recompiled %d graphs: %s", what, new, "; ".join(fresh) or "a new input structure")
