"""Shared test helpers: a small token model in parts, its single-process reference, a gloo spawner."""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from duplexpipe.launch.processes import cuda_device_for, default_backend, free_port, start_context
from duplexpipe.schedules.ir import Schedule

VOCAB, DIM, SEQ = 11, 8, 3


class Block(nn.Module):
    """Pre-norm residual MLP block: x + W2 gelu(W1 LN(x))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.norm(x))


def make_parts(num_parts: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    """The model as `num_parts` stages: token embedding + block, blocks, block + head."""
    torch.manual_seed(seed)
    parts: list[nn.Module] = []
    for k in range(num_parts):
        layers: list[nn.Module] = [nn.Embedding(VOCAB, DIM)] if k == 0 else []
        layers.append(Block(DIM))
        if k == num_parts - 1:
            layers.append(Head(DIM, VOCAB))
        parts.append(nn.Sequential(*layers).to(dtype))
    return parts


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(rows: int, seed: int) -> tuple[Tensor, Tensor]:
    """Token ids (rows, SEQ) and next-token targets."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    return tokens, targets


def reference(parts: Sequence[nn.Module], batches: Sequence[tuple[Tensor, Tensor]],
              dtype: torch.dtype = torch.float64) -> tuple[list[float], list[list[Tensor]], Tensor]:
    """One process, whole batches (float64 by default): per-batch mean losses, gradients
    accumulated over all batches, and the last batch's logits."""
    model = nn.Sequential(*[copy.deepcopy(p).to(dtype) for p in parts])
    losses = []
    logits = torch.empty(0)
    for tokens, targets in batches:
        logits = model(tokens)
        loss = loss_fn(logits, targets)
        loss.backward()
        losses.append(loss.item())
    grads = [[p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in part.parameters()]
             for part in model]
    return losses, grads, logits.detach()


def stage_modules(schedule: Schedule, rank: int, parts: Sequence[nn.Module]) -> dict[int, nn.Module]:
    """This rank's stages, each its own copy of its weight group's part."""
    return {s: copy.deepcopy(parts[schedule.stages[s].group]) for s in schedule.stages_of_rank(rank)}


def rel_err(got: Tensor, want: Tensor) -> float:
    """Norm-wise relative error ||got - want|| / ||want|| (absolute when want is 0), in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    scale = want.norm().item()
    diff = (got - want).norm().item()
    return diff / scale if scale > 0 else diff


@contextlib.contextmanager
def shared_folder(prefix: str) -> Iterator[str]:
    """A temporary folder that rank 0 makes and names to every rank; rank 0 removes it (and its `-*` siblings) once
    every rank has left the block without an error."""
    where = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where, src=0)
    yield where[0]
    dist.barrier()
    if dist.get_rank() == 0:
        for path in [where[0], *(str(p) for p in Path(where[0]).parent.glob(Path(where[0]).name + "-*"))]:
            shutil.rmtree(path, ignore_errors=True)


def _wait_for_peers(rank: int, world: int, limit_s: float = 30.0) -> None:
    """Stay alive until every rank has reported (an exited peer breaks pending transfers); rank 0,
    which hosts the store, leaves last.

    Counts through the c10d store, not a collective: a failure case may leave the group's
    transfers pending on purpose, so a barrier there could not complete.
    """
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    deadline = time.monotonic() + limit_s

    def wait_for(key: str, count: int) -> None:
        while store.add(key, 0) < count and time.monotonic() < deadline:
            time.sleep(0.02)

    store.add("run_workers/done", 1)
    wait_for("run_workers/done", world)
    if rank:
        store.add("run_workers/left", 1)
    else:
        wait_for("run_workers/left", world - 1)


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
           out: Any, backend: str, timeout_s: float) -> None:
    """One worker: the process group (each collective bounded by the job's own limit, `timeout_s`: a first step that
    compiles for a minute on a loaded machine is slow, not failed), then `fn`, its result or traceback put on `out`."""
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(cuda_device_for(rank))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        out.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put((rank, False, traceback.format_exc()))
    try:
        _wait_for_peers(rank, world)
    except Exception:  # noqa: BLE001, S110 - best effort (rank 0, hosting the store, may be gone)
        pass
    finally:
        out.close()
        out.join_thread()
        os._exit(0)  # skip teardown: failure cases leave transfers pending on purpose


def nccl_ranks_fit(world: int) -> bool:
    """True when `world` NCCL ranks can run here: a GPU each, or $DUPLEXPIPE_SHARE_GPU=1 and one GPU."""
    return default_backend(world) == "nccl"


def run_workers(fn: Callable[..., Any], world: int, args: tuple[Any, ...] = (),
                timeout_s: float = 120.0, backend: str = "gloo") -> list[Any]:
    """Run fn(rank, world, *args) in `world` fresh processes (gloo on 127.0.0.1, or nccl with
    one GPU per rank); return each rank's result (plain data: tensors do not outlive workers).

    Raises AssertionError with the worker tracebacks when one fails, or when they do not all
    finish within timeout_s (the processes are then killed).
    """
    ctx = start_context("forkserver")  # a worker starts in under a second: torch is imported once
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, out, backend, timeout_s), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, ok, payload = out.get(timeout=0.5)
                results[rank] = (ok, payload)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    break
    finally:
        for proc in procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
    failures = [f"rank {r}:\n{p}" for r, (ok, p) in sorted(results.items()) if not ok]
    missing = sorted(set(range(world)) - set(results))
    if failures or missing:
        raise AssertionError(f"workers failed (missing ranks {missing}):\n" + "\n".join(failures))
    return [results[r][1] for r in range(world)]
