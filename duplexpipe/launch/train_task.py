"""A training task: `TrainTask` (a model and its data) and loading the task function a run names."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from duplexpipe.launch.train_config import TrainConfig
from duplexpipe.model.stages import PartInit
from duplexpipe.tp.plans import TPPlan
from duplexpipe.train.trainer import LossFn


@dataclass
class TrainTask:
    """A model and its data, built on every rank by the task function."""

    layers: Sequence[nn.Module]
    """The blocks to split over the model parts (an nn.Sequential works too; on the meta device with `init`)."""
    loss_fn: LossFn
    """loss_fn(output, targets) -> mean loss of a microbatch."""
    batch: Callable[[int, int], tuple[Any, Any]]
    """batch(index, batch_size) -> (inputs, targets): the global batch number `index` (0, 1, ...), identical on every
    rank; optimizer step s trains batches s x A .. s x A + A - 1 with `accumulation_steps` A (one batch a step: A=1).
    Inputs (and targets) are a tensor or a tuple / list / dict of tensors, each with the samples in its first
    dimension (the run slices them per data-parallel replica and microbatch)."""
    embedding: nn.Module | None = None
    """Runs before the first block, in model part 0."""
    head: nn.Module | None = None
    """Runs after the last block, in the last model part."""
    init: PartInit | None = None
    """init(part, k) for layers built on the meta device: only this rank's parts are allocated and filled."""
    items_per_sample: int = 1
    """Items (e.g. tokens) per sample, for the throughput figure."""
    item_name: str = "samples"
    """What an item is called in the progress output."""
    pretrained: str | None = None
    """A Hugging Face model directory: the pipeline is `Pipeline.from_pretrained(pretrained)` (layers, embedding,
    head and init are then unused; `batch` gives (input_ids, labels)) and `--save-pretrained` can write it back."""
    dtype: torch.dtype | None = None
    """The dtype of a `pretrained` model (None: the checkpoint's)."""
    eval_batch: Callable[[int, int], tuple[Any, Any]] | None = None
    """eval_batch(index, batch_size) -> (inputs, targets): held-out batch number `index` (0, 1, ...), identical on
    every rank, as `batch` gives them; `--eval-every` reports the mean loss over the first `--eval-batches` of them.
    None: the task holds nothing out."""
    router_bias_update_speed: float = 0.0
    """A `pretrained` MoE model whose routers have an expert bias (DeepSeek-V3): how far each bias moves after an
    optimizer step (the aux-loss-free balance; 0: it stays)."""
    tp_plan: Callable[[bool], TPPlan] | None = None
    """tp_plan(sequence_parallel) -> the tensor-parallel plan of the parts `Pipeline.from_layers` makes (children
    `embedding`, `layer<i>`, `head`), for `--tp` > 1 (None: the task cannot run tensor-parallel; a `pretrained`
    model uses its published plan)."""


def load_task(spec: str, *, annotated: bool = False) -> Callable[..., TrainTask]:
    """Resolve "file.py:function" or "module:function" to the task function (importing its module runs it). Only a
    Python function is accepted (a builtin such as os:system, a class or another callable is refused before it is
    called); `annotated` (a task named by a config file): only one annotated `-> TrainTask`."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"task {spec!r} must look like 'path/to/file.py:function' or 'module:function'")
    if annotated:
        _check_declared(target, name, spec)  # from its source: nothing of the module runs before this holds
    if target.endswith(".py"):
        module = _load_file(target, spec)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(f"task {spec!r}: cannot import {target} ({exc})") from None
        except Exception as exc:
            raise ValueError(f"task {spec!r}: importing {target} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"task {spec!r}: {target} has no function {name!r}")
    if not inspect.isfunction(fn):
        raise ValueError(f"task {spec!r}: {name} is a {type(fn).__name__}, not a task function (a Python function "
                         "returning a TrainTask); refused without calling it")
    if annotated and not _returns_task(fn):
        raise ValueError(f"task {spec!r} comes from a config file, but {name} is not annotated '-> TrainTask'; a "
                         "config file may only name task functions declared to return a TrainTask (annotate it, or "
                         "name it with --task on the command line)")
    return fn  # type: ignore[no-any-return]


def _check_declared(target: str, name: str, spec: str) -> None:
    """ValueError unless the source of `target` (a task file, or a module found without importing it) defines a
    top-level function `name` annotated `-> TrainTask`: a config file's task is refused before its module runs."""
    refused = (f"task {spec!r} comes from a config file, but {target} does not define a function {name} annotated "
               "'-> TrainTask'; a config file may only name task functions declared to return a TrainTask (annotate "
               "it, or name it with --task on the command line); refused without importing {target}")
    if target.endswith(".py"):
        origin: str | None = target
    else:
        try:
            found = importlib.util.find_spec(target)  # imports the parent packages of a dotted name, not the module
        except (ImportError, ValueError):
            found = None
        origin = found.origin if found is not None else None
    if origin is None or not origin.endswith(".py") or not Path(origin).is_file():
        raise ValueError(refused.replace("{target}", target))
    try:
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"), filename=origin)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"task {spec!r}: cannot read {origin} ({type(exc).__name__}: {exc})") from None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name and node.returns is not None:
            if ast.unparse(node.returns).strip("'\" ").rsplit(".", 1)[-1] == TrainTask.__name__:
                return
    raise ValueError(refused.replace("{target}", target))


def _returns_task(fn: Callable[..., Any]) -> bool:
    """True when `fn` is annotated to return a TrainTask (the class, or its name as text)."""
    annotation = inspect.signature(fn).return_annotation
    if isinstance(annotation, str):
        return annotation.rsplit(".", 1)[-1].strip() == TrainTask.__name__
    return annotation is TrainTask


def _load_file(target: str, spec: str) -> Any:
    """The module of task file `target`, imported once per process with its folder on sys.path (so it can
    import the helpers beside it); an error while importing it is a ValueError naming the file."""
    path = Path(target).resolve()
    if not path.is_file():
        raise ValueError(f"task file {target!r} does not exist")
    digest = hashlib.sha1(str(path).encode(), usedforsecurity=False).hexdigest()[:10]
    module_name = f"duplexpipe_task_{path.stem}_{digest}"  # one module per file, not per file name
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    assert loader_spec is not None and loader_spec.loader is not None
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        where = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) and exc.lineno else ""
        raise ValueError(f"task {spec!r}: importing {target} failed{where}: {type(exc).__name__}: {exc}") from exc
    return module


def build_task(config: TrainConfig) -> TrainTask:
    """Call the task function with task_options (plus `seed=config.seed` when it takes a seed)."""
    fn = load_task(config.task)
    options = dict(config.task_options)
    if "seed" not in options and "seed" in inspect.signature(fn).parameters:
        options["seed"] = config.seed
    task = fn(**options)
    if not isinstance(task, TrainTask):
        raise TypeError(f"task {config.task!r} returned a {type(task).__name__}, not a TrainTask")
    check_task(task, config.task)
    return task


def check_task(task: TrainTask, spec: str) -> None:
    """TypeError naming the field when a TrainTask's parts are not what the run calls them as."""
    layers = list(task.layers) if isinstance(task.layers, (nn.Sequential, nn.ModuleList, list, tuple)) else None
    if task.pretrained is None and (layers is None or not all(isinstance(m, nn.Module) for m in layers)):
        raise TypeError(f"task {spec!r}: TrainTask.layers must be an nn.Sequential or a list of nn.Module, got "
                        f"{type(task.layers).__name__}")
    for name in ("loss_fn", "batch"):
        if not callable(getattr(task, name)):
            raise TypeError(f"task {spec!r}: TrainTask.{name} must be callable, got "
                            f"{type(getattr(task, name)).__name__}")
    for name in ("embedding", "head"):
        value = getattr(task, name)
        if value is not None and not isinstance(value, nn.Module):
            raise TypeError(f"task {spec!r}: TrainTask.{name} must be an nn.Module or None, got "
                            f"{type(value).__name__}")

