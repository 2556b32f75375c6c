"""Compiled stages: `PipelineConfig.compile` checked (torch.compile's own options, or a clear ValueError), which blocks
of a stage torch.compile compiles (in place), with which backend, and the log of what compiled when (the first
step, a recompilation and why).

Blocks, as torchtitan compiles them: the layers of a `from_layers` part, the blocks a part names itself
(`compile_blocks()`, e.g. a Hugging Face part's decoder layers), else the whole part. Inside a block holding MoE
layers, the pieces around them (norms, the mixer, the router) are compiled and the expert dispatch, its exchanges
and the deferrable projections (`moe.linear`) stay eager. Blocks compile in place (`nn.Module.compile`): state dict
names do not change, and the step runs after every other module transform (checkpointing wrappers, expert sharding,
data-parallel wrapping, tensor parallelism's `parallelize_module`: blocks with DTensor parameters, as torchtitan
composes them; static shapes there unless the user sets `dynamic`). Under a schedule with a split backward (I and
W), inductor and aot_eager compile through `runtime.backward.compiled.SplitBackend`, whose regions' backward runs as
an I graph and a W graph; parts the user compiled are left as they are (their regions keep one backward graph,
run at I: `runtime.backward.graph`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from duplexpipe.config.compile import backend_name, first_line_of
from duplexpipe.config.compile import compile_options as compile_options
from duplexpipe.model.stages import inner_module, part_blocks
from duplexpipe.moe.layer import MoELayer
from duplexpipe.runtime.backward import compat
from duplexpipe.runtime.backward.compiled import SPLIT_BACKENDS, SplitBackend
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.ir import Op, Schedule

LOG = logging.getLogger("duplexpipe.compile")
MAX_REASONS = 32
"""Distinct recompilation reasons logged per pipeline (each once)."""
CompileReport = Callable[[str, str, bool], None]
"""report(what, text, routine): a line of what compiled (`CompiledStages.report_to`)."""


# ------------------------------------------------------------------------------------------- the settings
CUDA_GRAPHS = "triton.cudagraphs"
"""The inductor option CUDA graphs hang on (modes "reduce-overhead" and "max-autotune" turn it on)."""


def uses_cuda_graphs(options: Mapping[str, Any]) -> bool:
    """Whether the options turn on inductor's CUDA graphs (a mode or the option itself)."""
    if backend_name(options) == "cudagraphs":
        return True
    if backend_name(options) != "inductor":
        return False
    mode = options.get("mode")
    patched = (compat.inductor_mode_settings(mode) if mode else {}) | dict(options.get("options") or {})
    return bool(patched.get(CUDA_GRAPHS, False))


def check_usable(options: Mapping[str, Any], device: torch.device, split: bool) -> None:
    """What only the device and schedule tell: inductor needs a C++ compiler on the CPU and triton on a GPU; CUDA
    graphs need a GPU and cannot run a backward in two parts (a schedule with I and W). ValueError otherwise."""
    name = backend_name(options)
    if name == "inductor" and device.type == "cpu":
        problem = compat.cpp_compiler_problem()
        if problem is not None:
            raise ValueError(f"PipelineConfig.compile: inductor on the CPU needs a C++ compiler: "
                             f"{first_line_of(problem)}")
    if name == "inductor" and device.type == "cuda":
        if not compat.has_triton():
            raise ValueError("PipelineConfig.compile: inductor on a GPU needs triton, which is not installed")
    if uses_cuda_graphs(options):
        if device.type != "cuda":
            raise ValueError(f"PipelineConfig.compile={dict(options)!r} uses CUDA graphs, which need a GPU "
                             f"(device {device})")
        if split:
            raise ValueError(f"PipelineConfig.compile={dict(options)!r} uses CUDA graphs, which replay a region's "
                             "backward whole; this schedule runs it in two parts (I and W): use mode "
                             "'max-autotune-no-cudagraphs' or a schedule without a split backward")


# ---------------------------------------------------------------------------------------- the application
def user_compiled(module: nn.Module) -> bool:
    """Whether `module` or a submodule was compiled by the user (torch.compile's wrapper, or Module.compile)."""
    return any(compat.compiled_by_user(m) for m in module.modules())


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
    blocks = part_blocks(part) or [part]
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
        if any(compat.compiled_in_place(m) for part in sources for m in part.modules()):
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
        self._watched: set[str] = set()
        self._seen: set[str] = set()
        self._report: CompileReport | None = None

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

    def report_to(self, report: CompileReport | None) -> None:
        """Send the lines `watching` logs to `report(what, text, routine)` instead of the log (None: the log again);
        `routine`: the first step's and a first evaluation's lines, which every rank has, rather than a
        recompilation (`duplexpipe train` prints them)."""
        self._report = report

    def _say(self, what: str, text: str, routine: bool) -> None:
        if self._report is None:
            LOG.info("%s%s", what, text)
        else:
            self._report(what, text, routine)

    @contextlib.contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Around a step or an evaluation (`what`: "step ..." or "evaluate"): the first one says that it compiles
        and how long it took, as does the first of another kind (an evaluation: no gradients and eval mode, which
        torch.compile guards on); later, new graphs are said with the time and the reasons dynamo gave (each reason
        once)."""
        if not self.active:
            yield
            return
        kind = what.split(" ", 1)[0]
        noun = "evaluation" if kind == "evaluate" else kind
        first, first_of_kind = self._steps == 0, kind not in self._watched
        self._steps += 1
        self._watched.add(kind)
        if first:
            cache = " (inductor reuses its cache across restarts)" if "inductor" in self.describe() else ""
            self._say("", f"compiling {self.describe()} on the first {noun}{cache}", True)
        elif first_of_kind:
            self._say(what, f": the first {noun} runs the compiled blocks without gradients (and in eval mode), which "
                      "torch.compile guards on: they compile again for it", True)
        graphs = compat.compiled_graph_count()
        known = {code: len(reasons) for code, reasons in compat.recompile_reasons().items()}
        start = time.perf_counter()
        yield
        new, took = compat.compiled_graph_count() - graphs, time.perf_counter() - start
        if first:
            self._say(what, f": compiled {new} graphs; the {noun} took {took:.1f} s", True)
        elif new:
            failures = compat.recompile_reasons().items()
            reasons = [r.split(": ", 1)[-1] for code, rs in failures for r in rs[known.get(code, 0):]]
            fresh = [r for r in dict.fromkeys(reasons) if r not in self._seen][:MAX_REASONS - len(self._seen)]
            self._seen.update(fresh)
            if fresh or not reasons or first_of_kind:
                why = "; ".join(fresh) or ("as before" if reasons else "a new input structure")
                self._say(what, f" recompiled {new} graphs in {took:.1f} s: {why}", first_of_kind)
