"""Stage modules: build one rank's stages from the model parts, with optional activation checkpointing."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from duplexpipe.pipeline.split import check_parts_fit
from duplexpipe.schedules.ir import Schedule


class CheckpointedStage(nn.Module):
    """Runs `module` under torch.utils.checkpoint: activations inside it are recomputed in backward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        return checkpoint(self.module, *args, use_reentrant=False, **kwargs)


def inner_module(module: nn.Module) -> nn.Module:
    """The user's module behind a CheckpointedStage wrapper (or `module` itself)."""
    return module.module if isinstance(module, CheckpointedStage) else module


def resolve_checkpointing(option: bool | Collection[int], schedule: Schedule) -> frozenset[int]:
    """The stage indices to checkpoint: all for True, none for False, else the given stages."""
    if isinstance(option, bool):
        return frozenset(range(schedule.num_stages)) if option else frozenset()
    stages = frozenset(option)
    bad = sorted(s for s in stages if not 0 <= s < schedule.num_stages)
    if bad:
        raise ValueError(
            f"activation_checkpointing names stages {bad}, but schedule {schedule.name!r} "
            f"has stages 0..{schedule.num_stages - 1}"
        )
    return stages


def build_stage_modules(
    schedule: Schedule,
    rank: int,
    parts: Sequence[nn.Module],
    *,
    checkpoint_stages: Collection[int] = (),
    device: torch.device | str | None = None,
) -> dict[int, nn.Module]:
    """This rank's stage modules: stage s gets a deep copy of model part `schedule.stages[s].group`.

    Copies of one part (DualPipe's mirrored stages) therefore start identical on every rank
    as long as every rank built `parts` identically (same seed or same state_dict).
    """
    check_parts_fit(len(parts), schedule)
    if not 0 <= rank < schedule.num_ranks:
        raise ValueError(f"rank {rank} is outside 0..{schedule.num_ranks - 1} for schedule {schedule.name!r}")
    modules: dict[int, nn.Module] = {}
    for stage in schedule.stages_of_rank(rank):
        module = copy.deepcopy(parts[schedule.stages[stage].group])
        if device is not None:
            module = module.to(device)
        modules[stage] = CheckpointedStage(module) if stage in checkpoint_stages else module
    return modules


def fingerprint(module: nn.Module) -> str:
    """A hash of the module's parameters and buffers (names, shapes, dtypes and values)."""
    digest = hashlib.sha256()
    for name, tensor in inner_module(module).state_dict().items():
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()[:20]


def find_mismatched_copies(
    schedule: Schedule, fingerprints: Sequence[Mapping[int, str]]
) -> list[tuple[int, list[tuple[int, str]]]]:
    """Groups whose copies differ: (group, [(stage, fingerprint) ...]).

    `fingerprints` holds one {stage: fingerprint} map per reporting rank (several maps may name
    the same stage, e.g. data-parallel replicas).
    """
    seen: dict[int, list[tuple[int, str]]] = {}
    for entry in fingerprints:
        for stage, fp in sorted(entry.items()):
            seen.setdefault(schedule.stages[stage].group, []).append((stage, fp))
    return [(g, copies) for g, copies in sorted(seen.items()) if len({fp for _, fp in copies}) > 1]
