"""schedule="auto"'s measurements cached per parts, sample and machine: the cache key and the shared lookup."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.planner.calibration_cache import CalibrationCache
from duplexpipe.planner.profile import Profile
from duplexpipe.runtime.structure import signature

LOGGER = logging.getLogger("duplexpipe.plan")


def machine_signature() -> dict[str, Any]:
    """The machine as the cache tells machines apart: host, CPU model, cores, torch and its threads."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": platform.node(), "cpu": model, "cores": cores, "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def parts_digest(parts: Sequence[nn.Module]) -> str:
    """A hash of the parts' structure: each module tree's repr and its parameters' and buffers' names, shapes,
    dtypes and devices (not their values: the costs do not depend on them)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode())
        for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
            grad = getattr(tensor, "requires_grad", False)
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.device.type}:{grad};".encode())
    return digest.hexdigest()[:32]


def sample_signature(value: Any) -> str:
    """The sample's structure, shapes and dtypes (`runtime.structure.signature`)."""
    if value is None:
        return "None"
    return str(signature(value))


def cache_of(spec: Any) -> CalibrationCache | None:
    """The cache that schedule_options["calibration_cache"] names: a directory, or None/False for none."""
    if spec is None or spec is False:
        return None
    if isinstance(spec, (str, os.PathLike)):
        return CalibrationCache(Path(spec))
    raise ValueError(f"schedule_options['calibration_cache'] must be a directory or None, got {spec!r}")


def cached_profile(cache: CalibrationCache | None, fingerprint: dict[str, Any],
                   measure: Callable[[], Profile]) -> tuple[Profile, str]:
    """Rank 0's cached profile for `fingerprint` on every rank, else `measure()` (called on every rank, a
    collective) stored by rank 0; with where it came from ("cache <path>", "measured, cached in <path>",
    "measured")."""
    lead = not dist.is_initialized() or dist.get_rank() == 0
    hit = cache.load(fingerprint) if cache is not None and lead else None
    found = [hit.to_dict() if hit is not None else None]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        assert cache is not None
        return Profile.from_dict(found[0], "calibration cache"), f"cache {cache.path(fingerprint)}"
    profile = measure()
    if cache is None:
        return profile, "measured"
    if lead:
        try:
            cache.store(fingerprint, profile)
        except OSError as exc:
            LOGGER.warning("schedule='auto': cannot write the calibration cache %s (%s)", cache.directory, exc)
            return profile, "measured"
    return profile, f"measured, cached in {cache.path(fingerprint)}"
