"""Launching: a one-machine process launcher and a torchrun-compatible (env://) entry point."""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(RuntimeError):
    """A launched rank failed (or the launch timed out); `rank` names it, `details` holds its traceback."""

    def __init__(self, message: str, rank: int | None = None, details: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.details = details


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def default_backend() -> str:
    """"nccl" when CUDA is available, else "gloo"."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def launched_by_torchrun() -> bool:
    """True when torchrun (or any env:// launcher) set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from the environment (env:// rendezvous, as torchrun sets it).

    Returns (rank, world_size). With NCCL the current CUDA device becomes LOCAL_RANK.
    """
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ValueError(f"environment lacks {', '.join(missing)}; start with torchrun or set them")
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _worker(fn: Callable[..., Any], args: Sequence[Any], rank: int, world: int, port: int,
            backend: str, results: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        init_from_env(backend)
        value = fn(*args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)
    shutdown(clean=True)


def shutdown(clean: bool) -> None:
    """Tear the process group down after `fn` returned (clean) or raised.

    Objects that still hold the group (runtimes, their pending Works) are collected first: one
    left for interpreter exit can destroy gloo's context after the group is gone, which aborts
    the process ("terminate called without an active exception"). After a clean run the ranks
    also meet at a barrier, so no rank tears down while a peer's last messages are in flight.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def _stop(procs: Sequence[Any]) -> None:
    """Terminate, then kill, every process still alive; reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float | None = None,
) -> list[Any]:
    """Run `fn(*args)` in `nprocs` fresh processes on this machine, one per rank, and return their results.

    Each process has the default group initialised (`backend`, 127.0.0.1, a free port) and
    RANK/WORLD_SIZE/LOCAL_RANK set. `fn` must be importable (module level) and its result
    picklable. If a rank fails the others are killed and LaunchError names the first failing
    rank with its traceback; after a timeout every rank is killed. No process outlives the call.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, tuple(args), r, nprocs, port, backend, results),
                         name=f"duplexpipe-rank{r}") for r in range(nprocs)]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, timeout_s)
    finally:
        _stop(procs)
        results.close()


def _collect(procs: Sequence[Any], results: Any, timeout_s: float | None) -> list[Any]:
    """Wait for one result per rank; raise LaunchError at the first failure, dead rank or timeout."""
    done: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(done) < len(procs):
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in done and p.exitcode is not None:
                    _raise_dead(r, p.exitcode, results, done)
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r in range(len(procs)) if r not in done]
                raise LaunchError(
                    f"launch timed out after {timeout_s:.0f}s; ranks {running} still running") from None
            continue
        if not ok:
            raise _first_failure(procs, results, done, rank, value)
        done[rank] = value
    for p in procs:
        p.join(30.0)
    return [done[r] for r in range(len(procs))]


def _first_failure(procs: Sequence[Any], results: Any, done: dict[int, Any], rank: int,
                   details: str) -> LaunchError:
    """The error to raise when `rank` reported a failure.

    A rank that died silently (killed, os._exit) is the likelier cause, since the others
    then fail on a closed connection: it is named first when there is one.
    """
    reported = {rank}
    while True:
        try:
            other, ok, value = results.get_nowait()
        except queue.Empty:
            break
        if ok:
            done[other] = value
        else:
            reported.add(other)
    silent = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported
              and r not in done]
    if not silent:
        return LaunchError(f"rank {rank} failed:\n{details}", rank, details)
    dead, code = silent[0], procs[silent[0]].exitcode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return LaunchError(f"rank {dead} {how} without reporting a result; then rank {rank} failed:\n{details}",
                       dead, details)


def _raise_dead(rank: int, exitcode: int, results: Any, done: dict[int, Any]) -> None:
    """A rank exited before its result was read: use its own report if one is in flight.

    Returns when the rank exited cleanly and its result arrived; otherwise raises LaunchError
    naming this rank (its traceback, or how it died).
    """
    errors: dict[int, str] = {}
    while True:
        try:
            other, ok, value = results.get(timeout=1.0)
        except queue.Empty:
            break
        if ok:
            done[other] = value
        else:
            errors.setdefault(other, value)
        if other == rank:
            break
    if rank in errors:
        raise LaunchError(f"rank {rank} failed:\n{errors[rank]}", rank, errors[rank])
    if rank in done and exitcode == 0:
        return
    how = f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}"
    raise LaunchError(f"rank {rank} {how} without reporting a result", rank)


def run(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    backend: str | None = None,
    timeout_s: float | None = None,
) -> list[Any]:
    """Run `fn(*args)` on every rank: in place under torchrun, else in `nprocs` local processes.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) this process is one rank:
    the group is initialised from the environment and the list holds only this rank's result.
    """
    if launched_by_torchrun():
        init_from_env(backend)
        try:
            result = [fn(*args)]
        except BaseException:
            shutdown(clean=False)
            raise
        shutdown(clean=True)
        return result
    return launch(fn, nprocs, args, backend=backend or "gloo", timeout_s=timeout_s)
