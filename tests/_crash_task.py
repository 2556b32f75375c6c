"""A `duplexpipe train` task for the restart tests: the bundled GPT, one thread per process, and one rank that
SIGKILLs itself when it fetches the batch of a given step on torchrun's first attempt."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

from duplexpipe.launch.attempts import restart_attempt
from duplexpipe.launch.tasks.gpt import gpt_task
from duplexpipe.launch.train_task import TrainTask

NATIVE_NOISE = "".join(
    ["[W1207 12:00:00.000000000 4242 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=5): Connection reset "
     "by peer\n", "Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:682 (most recent "
     "call first):\n"] + [f"frame #{i}: c10::Error::Error(...) + 0x{i:x} (0x7f in libc10.so)\n" for i in range(29)])
"""31 lines as torch's TCPStore client writes them (to file descriptor 2) when the rank serving the store is gone."""


def crash_task(kill_step: int = -1, kill_rank: int = 1, noise_rank: int = -1, mark: str = "",
               **options: Any) -> TrainTask:
    """gpt_task(**options); on attempt 0, global rank `kill_rank` dies (SIGKILL) fetching step `kill_step` (first
    creating the file `mark`, if named), and rank `noise_rank` writes NATIVE_NOISE to its standard error then."""
    torch.set_num_threads(1)  # the same arithmetic in every process, under torchrun or launch
    task = gpt_task(**options)
    batch = task.batch

    def dying_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == kill_step and restart_attempt() == 0 and int(os.environ.get("RANK", "-1")) == noise_rank:
            os.write(2, NATIVE_NOISE.encode())
        if step == kill_step and restart_attempt() == 0 and int(os.environ.get("RANK", "-1")) == kill_rank:
            if mark:
                Path(mark).write_text(f"rank {kill_rank} killed fetching step {step}\n", encoding="utf-8")
            os.kill(os.getpid(), signal.SIGKILL)
        return batch(step, batch_size)

    task.batch = dying_batch
    return task
