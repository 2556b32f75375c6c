"""Hugging Face checkpoints out: `save_pretrained` writes a directory transformers loads as is (config.json, one
safetensors shard per pipeline rank and their index) into a new folder beside the target and swaps it in whole; no
rank gathers the model."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from duplexpipe.errors import CheckpointError
from duplexpipe.model.hf_files import INDEX_FILE
from duplexpipe.moe.balance import expert_parameters
from duplexpipe.parallel import DPStrategy, ParallelGroups
from duplexpipe.schedules.ir import Schedule
from duplexpipe.train.checkpoint.names import stage_state_keys
from duplexpipe.train.part_chain import PartChain
from duplexpipe.train.planning.choice import AutoChoice

if TYPE_CHECKING:
    from duplexpipe.model.hf import CausalLMPart

SOURCE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                "chat_template.jinja", "chat_template.json")
"""Files of a model directory that `save_pretrained` copies from the source when present (tokenizer, generation)."""


class Exportable(Protocol):
    """What `save_pretrained` reads of a training pipeline (a `Pipeline` is one)."""

    schedule: Schedule
    groups: ParallelGroups
    dp: DPStrategy
    auto: AutoChoice | None
    source_dir: str | None

    @property
    def stage_state_modules(self) -> dict[int, nn.Module]: ...

    def bounded(self, work: Any, what: str) -> None: ...


def hf_parts(module: nn.Module) -> list[CausalLMPart]:
    """The Hugging Face parts a stage module runs (one, or several merged by schedule="auto")."""
    from duplexpipe.model.hf import CausalLMPart  # transformers loads when exporting, not with every checkpoint

    inner = list(module.parts) if isinstance(module, PartChain) else [module]
    return [p for p in inner if isinstance(p, CausalLMPart)]


def _tied_names(part: CausalLMPart) -> set[str]:
    """Names transformers stores once: the output head when it shares the token embedding's weight."""
    config = part.config.get_text_config() if hasattr(part.config, "get_text_config") else part.config
    return {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()


def _full(value: torch.Tensor) -> torch.Tensor:
    """A whole tensor on the CPU (a DTensor is gathered over its mesh, data- and tensor-parallel: every rank of it
    calls)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu()


def export_tensors(pipe: Exportable, experts_only: bool = False) -> tuple[dict[str, torch.Tensor],
                                                                         CausalLMPart | None]:
    """This rank's share of the model under transformers' names (first copies only, tied weights once; CPU tensors
    may be the parameters themselves: use them inside `pipe.dp.full_parameters()`; `experts_only`: its routed
    experts alone), and one of its Hugging Face parts (None when it has none)."""
    tensors: dict[str, torch.Tensor] = {}
    sample: CausalLMPart | None = None
    merged = pipe.auto.groups if pipe.auto is not None else None
    for stage, module in sorted(pipe.stage_state_modules.items()):
        parts = hf_parts(module)
        sample = sample or (parts[0] if parts else None)
        if not parts:
            raise ValueError(f"save_pretrained needs Hugging Face parts (Pipeline.from_pretrained or "
                             f"causal_lm_parts); stage {stage} runs a {type(module).__name__}")
        if pipe.schedule.copy_of_stage(stage) != 0:
            continue
        skip = _tied_names(parts[0])
        names = stage_state_keys(module, pipe.schedule.stages[stage].group, merged)
        own = {id(p) for p in expert_parameters(module)}
        for local, value in module.state_dict(keep_vars=True).items():
            wanted = names[local] not in skip and (id(value) in own or not experts_only)
            if wanted or isinstance(value, DTensor):  # a DTensor's gather needs every rank of its mesh (ZeRO-2/3)
                whole = _full(value)
                if wanted:
                    tensors[names[local]] = whole
    return tensors, sample


def _file_index(keys: list[str], group: Any) -> dict[str, int]:
    """Tensor name -> its shard's number (1..N: the writing ranks in pipeline order), the same on every writer."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, keys, group=group)
    writers = [names for names in everyone if names]
    return {name: i for i, names in enumerate(writers, start=1) for name in names}


def _carry_over(old: Path, new: Path) -> None:
    """Copy what a previous save's folder `old` holds besides the model files and index into the new folder `new`
    (adapters, a README, ...: they stay)."""
    if not old.is_dir():
        return
    for item in old.iterdir():
        if item.name == INDEX_FILE or (item.name.startswith("model") and item.name.endswith(".safetensors")):
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.copytree(item, new / item.name, symlinks=True)
        else:
            shutil.copy2(item, new / item.name, follow_symlinks=False)


RENAME_EXCHANGE = 2
"""renameat2's flag that swaps two paths in one step (Linux)."""
AT_FDCWD = -100


def swap_in(new: Path, target: Path) -> None:
    """Put folder `new` at `target` in one step (Linux: renameat2 exchanges them, then the old one is removed; a
    missing target: one rename); elsewhere the old one is renamed aside first."""
    if not target.exists() and not target.is_symlink():
        os.rename(new, target)
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = getattr(libc, "renameat2", None)
        if renameat2 is not None and renameat2(AT_FDCWD, os.fsencode(new), AT_FDCWD, os.fsencode(target),
                                               RENAME_EXCHANGE) == 0:
            shutil.rmtree(new, ignore_errors=True)  # the old folder, now at `new`
            return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, old / target.name)
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


def _same_folder(a: str | Path, b: str | Path | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def check_target(path: str | Path, source: str | None, overwrite: bool) -> None:
    """ValueError when `path` is the model folder the pipeline was loaded from (`source`) and `overwrite` is off:
    the export would replace the weights it started from."""
    if _same_folder(path, source) and not overwrite:
        raise ValueError(f"save_pretrained {path} is the model folder this run loaded its weights from; writing it "
                         "would replace them: pass overwrite=True (--save-pretrained-overwrite) or name another folder")


def _write_config(root: Path, part: CausalLMPart, dtype: torch.dtype, source: str | None) -> None:
    """config.json (with the model's class and dtype) and the source's tokenizer and generation files."""
    config = copy.deepcopy(part.config)
    config.architectures = [part.model_class]
    config.dtype = dtype
    config.save_pretrained(str(root))
    if source is None:
        return
    for name in SOURCE_FILES:
        src = Path(source) / name
        if src.is_file() and src.resolve() != (root / name).resolve():
            shutil.copyfile(src, root / name)


@contextlib.contextmanager
def _writers(pipe: Exportable) -> Iterator[tuple[Any, bool]]:
    """(the group that writes, whether this rank is in it): TP rank 0 of the pipeline of data-parallel replica 0,
    and with experts spread over an expert-parallel group every replica of that group (ranks (pp x dp + d) x tp,
    d < ep, as `make_mesh` lays them out; collective: every rank makes the group, which is destroyed after)."""
    groups = pipe.groups
    if groups.ep_size == 1 or not dist.is_initialized():
        yield groups.pp_group, groups.dp_rank == 0 and groups.tp_rank == 0
        return
    ranks = [(p * groups.dp_size + d) * groups.tp_size for p in range(groups.pp_size) for d in range(groups.ep_size)]
    group = dist.new_group(ranks)
    writes = groups.dp_rank < groups.ep_size and groups.tp_rank == 0
    try:
        yield group, writes
    finally:
        if writes:  # a member: its handle is a real group (the others hold a placeholder)
            dist.destroy_process_group(group)


def _write(pipe: Exportable, root: Path, tensors: dict[str, torch.Tensor], part: CausalLMPart, group: Any) -> None:
    """This rank's shard (collective over the writing group); the group's first rank: the rest."""
    mapping = _file_index(sorted(tensors), group) if dist.is_initialized() else dict.fromkeys(tensors, 1)
    dtype = next(iter(tensors.values())).dtype if tensors else torch.float32
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(root), fqn_to_index_mapping=mapping),
             process_group=group, no_dist=not dist.is_initialized())
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        _write_config(root, part, dtype, pipe.source_dir)


def _staging(target: Path, group: Any) -> Path:
    """The new folder beside `target` the writers fill (its name unpredictable, made by the group's first rank and
    shared with the others; what a previous save left besides its model files is copied in)."""
    box: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent))
        os.chmod(staging, 0o755 & ~_umask())
        _carry_over(target, staging)
        box[0] = str(staging)
    if dist.is_initialized():
        dist.broadcast_object_list(box, group=group, group_src=0)
    return Path(box[0])


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _export(pipe: Exportable, target: Path, tensors: dict[str, torch.Tensor], part: CausalLMPart,
            group: Any) -> str | None:
    """A writer: fill a new folder and (the group's first rank) swap it in; the error, naming the target, when that
    failed (the new folder is removed, the target left as it was)."""
    lead = not dist.is_initialized() or dist.get_rank(group) == 0
    staging: Path | None = None
    try:
        staging = _staging(target, group)
        _write(pipe, staging, tensors, part, group)
    except (OSError, CheckpointException) as exc:
        error: str | None = _why(exc, target)
    else:
        error = None
    if dist.is_initialized():  # every writer finished (or failed): the first one swaps, or cleans up
        said: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(said, error, group=group)
        error = next((e for e in said if e is not None), None)
    if lead and staging is not None:
        try:
            if error is None:
                swap_in(staging, target)
        except OSError as exc:
            error = _why(exc, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return error


def _why(exc: BaseException, target: Path) -> str:
    """A failed export in one line naming the target folder (the cause's file system error when there is one)."""
    root: BaseException = exc
    while isinstance(root, CheckpointException) and root.failures:
        root = root.failures[min(root.failures)][0]
    what = root.strerror if isinstance(root, OSError) and root.strerror else f"{type(root).__name__}: {root}"
    return (f"{what} while writing the Hugging Face model {target} (it is left as it was: the new files went to a "
            "folder beside it, now removed)")


def save_pretrained(pipe: Exportable, path: str, overwrite: bool = False) -> None:
    """Write `path` as a Hugging Face model directory: `AutoModelForCausalLM.from_pretrained(path)` loads it as is.

    Collective (every rank calls). Each stage's tensors are gathered whole over its TP group and, with ZeRO-2/3, its
    data-parallel group, one tensor at a time (`DTensor.full_tensor` per parameter, moved to the CPU before the
    next: a rank holds its own stages whole on the CPU, never the model, and one gathered tensor on the device) and
    the ranks of data-parallel replica 0 and TP rank 0 write: each pipeline rank its own shard
    `model-0000k-of-0000N.safetensors` (with torch.distributed.checkpoint's Hugging Face writer), its first rank the
    index, config.json and the source's tokenizer and generation files. With experts spread over an expert-parallel
    group, the other ranks of that group write a shard of their own experts each (every expert under its global
    index, as transformers saves them); no rank gathers the model.

    The files go to a new folder beside `path`, swapped in whole once every writer finished: readers see the old
    folder or the new one, and a failure (a full disk) leaves `path` as it was, raising CheckpointError naming it on
    every rank. The model folder the pipeline was loaded from is refused (ValueError) unless `overwrite`.
    """
    check_target(path, pipe.source_dir, overwrite)
    error = None
    with _writers(pipe) as (group, writes):  # the writers' group outlives the barrier: every rank is done with it
        with pipe.dp.full_parameters():
            tensors, part = export_tensors(pipe, experts_only=pipe.groups.ep_rank > 0)
            if writes and part is not None:
                error = _export(pipe, Path(path), tensors, part, group)
        if dist.is_available() and dist.is_initialized():
            error = _first_error(pipe, error)
    if error is not None:
        raise CheckpointError(error)


def _first_error(pipe: Exportable, error: str | None) -> str | None:
    """The export's outcome on every rank (bounded like the barrier it replaces): this rank's error, or a line
    naming the lowest rank that failed."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    failed = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    failed[dist.get_rank()] = int(error is not None)
    pipe.bounded(dist.all_reduce(failed, async_op=True), "the end of save_pretrained")
    ranks = failed.nonzero().flatten().tolist()
    if error is None and ranks:
        return f"save_pretrained stopped because rank {ranks[0]} failed"
    return error
