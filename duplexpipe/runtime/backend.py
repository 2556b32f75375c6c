"""The one test of which backend a process group runs on, and the device that follows from it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_nccl(group: Any = None) -> bool:
    """Whether `group` (None: the default group) runs on NCCL: its transfers run on the GPU, its waits are polled,
    and its messages are matched by order alone. Anything else (gloo) moves CPU tensors and blocks in the Work.
    A mixed backend ("cpu:gloo,cuda:nccl") counts as NCCL, as its CUDA tensors go through NCCL."""
    return "nccl" in str(dist.get_backend(group))


def default_device(group: Any = None) -> torch.device:
    """The current CUDA device when `group` (None: the default group) runs on NCCL and CUDA is available, else
    the CPU (also before torch.distributed is initialized)."""
    if dist.is_available() and dist.is_initialized() and is_nccl(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
