"""Checkpoint and resume a pipeline with torch.distributed.checkpoint, keyed by the model's own names.

Parameters and optimizer state are stored under global names (`model/state_names.py`): a checkpoint loads
into any schedule, pipeline size, partition, data-parallel size or ZeRO stage and continues exactly. State
tied to the layout (each rank's random-number generators, a compressing strategy's residuals) is restored
when the layout is the same and reset, with one warning, when it is not. Nothing is pickled by us: the
strategy state is tensors plus a JSON skeleton, and non-tensor values are read with weights_only=True;
torch.distributed.checkpoint's own .metadata file (a pickle) is read by an unpickler that admits only checkpoint
metadata classes (`storage`), so loading a checkpoint never runs code. Each checkpoint holds a manifest of
its files' checksums, written after every rank finished and checked before anything is read (`folder`).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from duplexpipe.comm.adaptive_links import LinkAdapter
from duplexpipe.dp_options.compression import compression_options
from duplexpipe.model.split import Partition
from duplexpipe.parallel import DPStrategy, ParallelGroups
from duplexpipe.schedules.ir import Schedule
from duplexpipe.train.checkpoint.folder import load_state, read_checked_metadata, save_state, verify_files
from duplexpipe.train.checkpoint.names import FORMAT, StateKeys, format_problems
from duplexpipe.train.checkpoint.plain_state import WeightsOnlyLoadPlanner, decode, encode
from duplexpipe.train.pipeline_config import PipelineConfig
from duplexpipe.train.planning.choice import AutoChoice
from duplexpipe.train.precision import DynamicLossScaler


class Checkpointable(Protocol):
    """What a checkpoint reads and restores of a training pipeline (a `Pipeline` is one)."""

    config: PipelineConfig
    schedule: Schedule
    groups: ParallelGroups
    dp: DPStrategy
    links: LinkAdapter | None
    auto: AutoChoice | None
    partition: Partition | None
    scaler: DynamicLossScaler
    scheduler: Any
    device: torch.device
    calls: int
    optimizer_steps: int

    @property
    def window_calls(self) -> int: ...

    @property
    def stage_state_modules(self) -> dict[int, nn.Module]: ...

    def bounded(self, work: Any, what: str) -> None: ...


def stage_dict(pipe: Checkpointable) -> nn.ModuleDict:
    """This rank's stage modules keyed `stage<s>` (unwrapped): the form the strategies' checkpoint dicts take."""
    return nn.ModuleDict({f"stage{s}": m for s, m in sorted(pipe.stage_state_modules.items())})


def set_trainer_state(pipe: Checkpointable, meta: dict[str, Any]) -> None:
    """Restore the counters, loss scaler and LR scheduler from a loaded `trainer_state`."""
    if meta["fresh_optimizer"]:
        pipe.dp.optimizer.state.clear()
    pipe.calls = int(meta["calls"])
    pipe.optimizer_steps = int(meta["optimizer_steps"])
    pipe.scaler.load_state_dict(meta["scaler"])
    if pipe.scheduler is not None:
        pipe.scheduler.load_state_dict(meta["scheduler"])


def check_scheduler(path: str, stored: dict[str, Any], has_scheduler: bool) -> None:
    """Raise ValueError when the checkpoint and the pipeline disagree on having an LR scheduler."""
    saved = any(k.startswith("trainer.scheduler.") for k in stored)
    if saved != has_scheduler:
        has, lacks = ("the checkpoint", "this Pipeline") if saved else ("this Pipeline", "the checkpoint")
        raise ValueError(f"{has} has an LR scheduler but {lacks} has none ({path}); build the Pipeline with "
                         "the same scheduler= as the run that saved it")


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rng_state() -> dict[str, torch.Tensor]:
    """This process's random-number generators, keyed by its global rank (unique across ranks, so each
    rank saves and restores its own): the torch CPU generator and every CUDA device's generator."""
    prefix = f"rank{rank()}"
    state = {f"{prefix}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"{prefix}.cuda{index}"] = cuda_state
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_state` returned (after loading it from a checkpoint)."""
    prefix = f"rank{rank()}"
    torch.set_rng_state(state[f"{prefix}.cpu"])
    devices = sorted(int(k.rsplit("cuda", 1)[1]) for k in state if k.startswith(f"{prefix}.cuda"))
    cuda = [state[f"{prefix}.cuda{index}"] for index in devices]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def quiet_sharded_tensor() -> Iterator[None]:
    """Hide torch's FutureWarning about ShardedTensor: ZeRO-1 stores its flat shards' pieces as ShardedTensor
    boxes (a DTensor cannot describe them), which torch.distributed.checkpoint still reads and writes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def check_between_windows(pipe: Checkpointable, verb: str) -> None:
    """Raise ValueError inside an accumulation window (the gradients of its calls are not in the checkpoint)."""
    if pipe.window_calls:
        raise ValueError(
            f"cannot {verb} a checkpoint inside an accumulation window ({pipe.window_calls} of "
            f"{pipe.config.accumulation_steps} calls done); {verb} after the optimizer step"
        )


def state_keys(pipe: Checkpointable) -> StateKeys:
    """How this rank's checkpoint dicts map to the model's global names."""
    return StateKeys.of(pipe.stage_state_modules, pipe.schedule, pipe.auto.groups if pipe.auto else None)


def layout(pipe: Checkpointable) -> str:
    """The layout per-rank state belongs to (schedule, sizes, partition, strategy), as JSON text."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    balance = list(pipe.partition.balance) if pipe.partition is not None else None
    return json.dumps({"schedule": pipe.schedule.name, "stages": pipe.schedule.num_stages,
                       "pp": pipe.groups.pp_size, "dp": pipe.groups.dp_size, "tp": pipe.groups.tp_size, "world": world,
                       "partition": balance,
                       "strategy": pipe.dp.name,
                       "compression": compression_options(pipe.config.data_parallel.grad_compression).method},
                      sort_keys=True)


def trainer_state(pipe: Checkpointable, fresh_optimizer: bool) -> dict[str, Any]:
    """The trainer's own counters (equal on every rank), and the LR scheduler's state when there is one."""
    state = {"format": FORMAT, "layout": layout(pipe), "calls": pipe.calls, "optimizer_steps": pipe.optimizer_steps,
             "fresh_optimizer": fresh_optimizer, "scaler": pipe.scaler.state_dict()}
    if pipe.scheduler is not None:
        state["scheduler"] = pipe.scheduler.state_dict()
    return state


def dp_state(pipe: Checkpointable) -> dict[str, Any]:
    """The data-parallel strategy's state (compression residuals, ...) of this rank as a JSON skeleton plus
    tensors `t<i>`, keyed by its global rank; {} when the strategy keeps none."""
    state = pipe.dp.state_dict()
    if not state:
        return {}
    skeleton, tensors = encode(state, f"the {pipe.dp.name} strategy's state")
    return {f"rank{rank()}": {"skeleton": skeleton, **{f"t{i}": t for i, t in enumerate(tensors)}}}


def dp_template(stored: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """What to read this rank's `dp_state` into (from the stored entries' shapes); {} when none is stored."""
    prefix = f"dp.rank{rank()}."
    mine = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}
    if not mine:
        return {}
    entry = {k: torch.empty(v.size, dtype=v.properties.dtype, device=device)
             if isinstance(v, TensorStorageMetadata) else "" for k, v in mine.items()}
    return {f"rank{rank()}": entry}


def set_dp_state(pipe: Checkpointable, loaded: dict[str, Any]) -> None:
    """Restore what `dp_state` saved (after loading `dp_template` from the checkpoint)."""
    for entry in loaded.values():
        count = sum(1 for k in entry if k.startswith("t") and k[1:].isdigit())
        pipe.dp.load_state_dict(decode(entry["skeleton"], [entry[f"t{i}"] for i in range(count)]))


def links_state(pipe: Checkpointable) -> dict[str, str]:
    """p2p_compression="adaptive": this rank's stage-link controller (its rungs) as JSON text keyed by its global
    rank; {} otherwise."""
    if pipe.links is None:
        return {}
    return {f"rank{rank()}": json.dumps(pipe.links.state_dict(), sort_keys=True)}


def links_template(pipe: Checkpointable, stored: dict[str, Any]) -> dict[str, str]:
    """What to read this rank's `links_state` into; {} when none is stored or this pipeline has no adaptive links."""
    key = f"rank{rank()}"
    return {key: ""} if pipe.links is not None and f"links.{key}" in stored else {}


def set_links_state(pipe: Checkpointable, loaded: dict[str, str]) -> None:
    """Restore what `links_state` saved: the stage links continue on their saved rungs."""
    for text in loaded.values():
        assert pipe.links is not None
        pipe.links.load_state_dict(json.loads(text))


def save_checkpoint(pipe: Checkpointable, path: str) -> None:
    """Write parameters and optimizer state under the model's names, trainer counters, and each rank's RNG and
    strategy state to directory `path` (all ranks call)."""
    check_between_windows(pipe, "save")
    fresh = not pipe.dp.optimizer.state
    model_sd, optim_sd = pipe.dp.checkpoint_dicts(stage_dict(pipe))
    if fresh:
        # checkpoint_dicts initialised the state with a zero-lr step; a fresh optimizer must stay fresh.
        pipe.dp.optimizer.state.clear()
    model, optim = state_keys(pipe).to_global(model_sd, optim_sd, loading=False)
    state = {"model": model, "optim": optim, "trainer": trainer_state(pipe, fresh), "rng": rng_state()}
    extra = dp_state(pipe)
    if extra:
        state["dp"] = extra
    links = links_state(pipe)
    if links:
        state["links"] = links
    with quiet_sharded_tensor():
        save_state(state, path)


def _saved_layout(path: str) -> str:
    """The layout the checkpoint was saved with (read by this rank alone)."""
    probe: dict[str, Any] = {"trainer": {"layout": ""}}
    load_state(probe, path, WeightsOnlyLoadPlanner(allow_partial_load=True), no_dist=True)
    return str(probe["trainer"]["layout"])


def load_checkpoint(pipe: Checkpointable, path: str) -> None:
    """Restore what `save_checkpoint` wrote into a pipeline of any layout (all ranks call); a checkpoint of the
    stage-keyed format 1 is refused on every rank, saying how to convert it (CHANGELOG.md)."""
    check_between_windows(pipe, "load")
    verify_files(path, collective=True)
    stored = read_checked_metadata(path).state_dict_metadata
    problems = format_problems(stored)
    if problems:
        raise ValueError(f"checkpoint {path}: {problems[0]}")
    modules = stage_dict(pipe)
    keys = state_keys(pipe)
    model_sd, optim_sd = pipe.dp.checkpoint_dicts(modules)
    model, optim = keys.to_global(model_sd, optim_sd, loading=True)
    check_names(pipe, path, stored, model, optim)
    check_scheduler(path, stored, pipe.scheduler is not None)
    saved = _saved_layout(path)
    same = saved == layout(pipe)
    state: dict[str, Any] = {"model": model, "optim": optim, "trainer": trainer_state(pipe, False)}
    if same:
        state["rng"] = rng_state()
        extra = dp_template(stored, pipe.device)
        if extra:
            state["dp"] = extra
        links = links_template(pipe, stored)
        if links:
            state["links"] = links
    with quiet_sharded_tensor():
        load_state(state, path, WeightsOnlyLoadPlanner())
    keys.to_local(model_sd, optim_sd, state["model"], state["optim"])
    if same:
        set_rng_state(state["rng"])
        set_dp_state(pipe, state.get("dp", {}))
        set_links_state(pipe, state.get("links", {}))
    pipe.dp.load_checkpoint_dicts(modules, model_sd, optim_sd)
    set_trainer_state(pipe, state["trainer"])
    if not same:
        _warn_reset(pipe, path, stored, saved)


def _warn_reset(pipe: Checkpointable, path: str, stored: dict[str, Any], saved: str) -> None:
    """One warning (from global rank 0) naming the per-rank state a layout change reset."""
    reset = ["the random-number generators of every rank (dropout streams)"]
    if any(k.startswith("dp.") for k in stored) or pipe.dp.state_dict():
        reset.append(f"the data-parallel strategy's state ({pipe.dp.name}: error-feedback residuals and "
                     "compressor state) of every rank")
    if rank() == 0:
        warnings.warn(f"checkpoint {path} was saved with another layout ({saved}; now "
                      f"{layout(pipe)}): parameters, optimizer and trainer state were loaded; reset "
                      + " and ".join(reset), UserWarning, stacklevel=3)


def _gathered(values: list[str]) -> list[list[str]]:
    """Every rank's list (this rank's alone without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [values]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def check_names(pipe: Checkpointable, path: str, stored: dict[str, Any], model: dict[str, Any],
                optim: dict[str, Any]) -> None:
    """Raise ValueError on every rank when the checkpoint's names or shapes do not match the model: the first
    missing and unexpected names, or the first shape that differs (collective: all ranks call)."""
    wanted = [f"model.{k}" for k in model]
    missing = [k for k in wanted + [f"optim.{k}" for k in optim] if k not in stored]
    shapes = [f"{k}: {tuple(stored[k].size)} in the checkpoint, {tuple(model[k[6:]].shape)} here"
              for k in wanted if k in stored and isinstance(stored[k], TensorStorageMetadata)
              and isinstance(model[k[6:]], torch.Tensor) and tuple(stored[k].size) != tuple(model[k[6:]].shape)]
    everyone = _gathered(["W" + k for k in wanted] + ["M" + k for k in missing] + ["S" + s for s in shapes])
    flat = [item for per_rank in everyone for item in per_rank]
    expected = {item[1:] for item in flat if item[0] == "W"}
    all_missing = sorted({item[1:] for item in flat if item[0] == "M"})
    all_shapes = sorted({item[1:] for item in flat if item[0] == "S"})
    unexpected = sorted(k for k in stored if k.startswith("model.") and k not in expected)
    if all_missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match this model: {len(all_missing)} names missing "
                         f"({_shown(all_missing) or 'none'}), {len(unexpected)} unexpected "
                         f"({_shown(unexpected) or 'none'}); was it saved from another model or optimizer?")
    if all_shapes:
        raise ValueError(f"checkpoint {path} does not match this model: {len(all_shapes)} shapes differ "
                         f"({_shown(all_shapes)})")


def read_checkpoint(path: str) -> dict[str, Any]:
    """Every entry of a checkpoint in this process, by its stored name (`model.<name>`, `optim.state.<name>.<key>`,
    `trainer.calls`, ...): tensors whole (however they were sharded), other values as saved. The files are checked
    against the manifest first and nothing read runs code; CheckpointError (a ValueError) names what is wrong."""
    verify_files(path, collective=False)
    stored = read_checked_metadata(path).state_dict_metadata
    flat: dict[str, Any] = {k: torch.empty(v.size, dtype=v.properties.dtype)
                            if isinstance(v, TensorStorageMetadata) else None for k, v in stored.items()}
    load_state(flat, path, WeightsOnlyLoadPlanner(), no_dist=True)
    return flat
