"""Launching: a one-machine process launcher and a torchrun-compatible (env://) entry point."""

from __future__ import annotations

import datetime
import gc
import logging
import multiprocessing as mp
import os
import pickle
import queue
import random
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from duplexpipe.errors import LaunchError, StoppedByPeer
from duplexpipe.launch.attempts import AGENT_STORE_ENV, attempt_prefix
from duplexpipe.launch.failures import (
    GRACE_S,
    Failure,
    blamed_rank,
    error_summary,
    lost_a_peer,
    record_failure,
)
from duplexpipe.launch.lifetime import die_with_parent, restore_signals, stop_on_signals, watch_launcher
from duplexpipe.launch.rank_output import RankOutput, send_stderr_to

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LOOPBACK = "127.0.0.1"
"""The only address a local job (`launch`, `run` and `duplexpipe train` without torchrun) listens on."""
LOOPBACK_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Variables a local job's ranks get set to the loopback interface (unless set already), so that gloo's and NCCL's
sockets listen and connect on it alone."""
log = logging.getLogger("duplexpipe.launch")


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000
"""free_port draws from LOWEST_PORT up to the kernel's ephemeral range."""


def ephemeral_low(path: str = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the range the kernel gives outgoing connections and bind(0) (32768 where unknown)."""
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", tries: int = 100) -> int:
    """A TCP port that was free on `host` a moment ago, drawn at random below the kernel's ephemeral range: a port
    from bind(0) is one the kernel also hands to outgoing connections (other jobs' gloo sockets), which can take it
    before the job's rank 0 binds it; a random one below that range is only ever taken by another such draw."""
    draw = random.Random()
    high = ephemeral_low()
    for _ in range(tries if high > LOWEST_PORT else 0):
        port = draw.randrange(LOWEST_PORT, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


SHARE_GPU_ENV = "DUPLEXPIPE_SHARE_GPU"
"""Set to 1 to let NCCL ranks share this machine's GPUs (testing the NCCL paths on a one-GPU machine)."""


def cuda_device_for(local_rank: int) -> int:
    """The CUDA device index of the NCCL rank `local_rank` on this machine (its own GPU).

    NCCL refuses two ranks of one communicator on one GPU. With $DUPLEXPIPE_SHARE_GPU=1 and fewer GPUs
    than ranks, ranks share them round-robin: each rank then names itself a host of its own
    (NCCL_HOSTID), so NCCL moves messages over its socket transport on the loopback interface as
    between machines. That runs every NCCL code path of the runtime, at socket speed: for tests only.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank < gpus:
        return local_rank
    if gpus == 0 or os.environ.get(SHARE_GPU_ENV) != "1":
        raise ValueError(f"NCCL rank {local_rank} needs GPU {local_rank}, but this machine has {gpus}; "
                         f"use gloo, or set {SHARE_GPU_ENV}=1 to share GPUs (testing only)")
    os.environ["NCCL_HOSTID"] = f"duplexpipe-shared-gpu-rank-{local_rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    return local_rank % gpus


def default_backend(local_procs: int | None = None) -> str:
    """"nccl" when CUDA has a device for each of the `local_procs` processes on this machine (default:
    LOCAL_WORLD_SIZE, else 1) or $DUPLEXPIPE_SHARE_GPU=1 lets them share one, else "gloo"."""
    if local_procs is None:
        local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and (torch.cuda.device_count() >= local_procs
                                      or os.environ.get(SHARE_GPU_ENV) == "1"):
        return "nccl"
    return "gloo"


def _log_backend(backend: str, nprocs: int, where: str) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = "one GPU per process" if backend == "nccl" else (
        f"{gpus} GPUs for {nprocs} processes" if gpus else "no GPU") if backend == "gloo" else "as asked"
    log.info("duplexpipe: %d processes %s on %s (%s)", nprocs, where, backend, why)


def launched_by_torchrun() -> bool:
    """True when torchrun (or any env:// launcher) set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def attempt_store(timeout_s: float) -> dist.Store:
    """A client of torchrun's agent store with keys under a prefix of this restart attempt.

    The agent's store outlives its workers: after a restart, torch 2.13's env:// rendezvous reads the dead
    attempt's keys (addresses of exited workers) and fails or hangs (pytorch/pytorch#167288 reports the same
    for NCCL). A prefix per attempt keeps each attempt to its own keys; every wait is bounded by `timeout_s`.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(attempt_prefix("pg"), store)


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from the environment (env:// rendezvous, as torchrun sets it).

    Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) the ranks meet on keys of their own restart
    attempt (`attempt_store`), so workers restarted by `torchrun --max-restarts N` rendezvous again; every wait
    (the store, the group's collectives) is bounded by `timeout_s`. Returns (rank, world_size). With NCCL the
    current CUDA device becomes LOCAL_RANK.
    """
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ValueError(f"environment lacks {', '.join(missing)}; start with torchrun or set them")
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(cuda_device_for(int(os.environ.get("LOCAL_RANK", "0"))))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if os.environ.get(AGENT_STORE_ENV, "").lower() == "true":
            dist.init_process_group(backend, store=attempt_store(timeout_s), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        else:
            try:
                dist.init_process_group(backend, init_method="env://", timeout=timeout)
            except dist.DistNetworkError as exc:
                if "EADDRINUSE" not in str(exc):
                    raise
                raise ValueError(f"MASTER_PORT {os.environ['MASTER_PORT']} on {os.environ['MASTER_ADDR']} is taken "
                                 "by another process: rank 0 cannot serve the rendezvous there; choose a free port "
                                 "(torchrun --master-port)") from None
    return dist.get_rank(), dist.get_world_size()


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS), None when it has neither."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def local_environment(environ: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    """The environment of rank `rank` of a local job: the launcher's, the torchrun-style variables, and gloo's and
    NCCL's socket interface set to loopback unless the launcher's environment names one."""
    env = dict(environ)
    env.update({"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    interface = loopback_interface()
    if interface is not None:
        for name in LOOPBACK_ENV:
            env.setdefault(name, interface)
    return env


def loopback_store(rank: int, world: int, port: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of a local job: rank 0 serves it on LOOPBACK:`port` alone (torch's own TCPStore server
    listens on every interface), the other ranks connect to it there."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(LOOPBACK, port, world, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, port))
        sock.listen(max(128, world))
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(LOOPBACK, port, world, True, timeout, master_listen_fd=sock.detach())


def init_local(backend: str, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group of a rank started by `launch` (its environment from
    `local_environment`): over `loopback_store`, every wait bounded by `timeout_s`. Returns (rank, world_size)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        torch.cuda.set_device(cuda_device_for(int(os.environ.get("LOCAL_RANK", "0"))))
    if not dist.is_initialized():
        store = loopback_store(rank, world, int(os.environ["MASTER_PORT"]), timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _worker(fn: Callable[..., Any], args: Sequence[Any], rank: int, world: int, port: int,
            backend: str, results: Any, environ: dict[str, str], lifeline: Any = None,
            output: str | None = None) -> None:
    die_with_parent()
    if output is not None:
        send_stderr_to(output)
    if lifeline is not None:
        watch_launcher(lifeline)
    os.environ.clear()  # the launcher's environment now, not the one a fork server started with
    os.environ.update(local_environment(environ, rank, world, port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        init_local(backend)
        value = fn(*args)
        # plain pickle copies tensors into the message: torch's queue pickler would share them
        # through this process, which exits before the parent reads them
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, Failure(traceback.format_exc(), blamed_rank(exc, rank), error_summary(exc))))
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
    """Terminate, then kill, every process still alive; reap them all (those that never started: nothing)."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in started:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)


START_METHODS = ("forkserver", "spawn")
"""How `launch` starts its processes: "forkserver" (the default: forked from one server process that imported
FORKSERVER_PRELOAD once, started by the first launch; well under a second per rank after that; each rank
takes the launcher's environment at its launch, but what torch read when the server imported it, e.g.
OMP_NUM_THREADS, stays the server's) or "spawn" (a fresh interpreter per rank importing torch itself: a few
seconds per rank, everything read from the environment of the launch)."""
START_METHOD_ENV = "DUPLEXPIPE_START_METHOD"
"""The environment variable `launch` reads when no start_method is given (default "forkserver")."""
DEFAULT_START_METHOD = START_METHODS[0]
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "duplexpipe.train.trainer", "duplexpipe.model.trace_split",
                      "duplexpipe.launch.processes")
"""What the fork server imports before forking ranks (the training API)."""
PRELOAD_WHEN_LOADED = {"transformers": "transformers.modeling_utils"}
"""What the fork server also imports when the launcher has imported the package (a Hugging Face run: the ranks
then start about 3 s of CPU sooner each)."""


def start_context(method: str | None = None) -> Any:
    """The multiprocessing context for `method` (None: $DUPLEXPIPE_START_METHOD, else "forkserver")."""
    method = method or os.environ.get(START_METHOD_ENV) or DEFAULT_START_METHOD
    if method not in START_METHODS:
        raise ValueError(f"start_method {method!r} is not one of {START_METHODS} (from the argument or "
                         f"${START_METHOD_ENV})")
    ctx = mp.get_context(method)
    if method == "forkserver":  # read when the server starts (the first launch of this process)
        loaded = [module for package, module in PRELOAD_WHEN_LOADED.items() if package in sys.modules]
        ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, *loaded])
    return ctx


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float | None = None,
    grace_s: float = GRACE_S,
    start_method: str | None = None,
    started: Callable[[list[int]], None] | None = None,
) -> list[Any]:
    """Run `fn(*args)` in `nprocs` fresh processes on this machine, one per rank, and return their results.

    Each process has the default group initialised (`backend`, a store on 127.0.0.1 at a free port, gloo's and
    NCCL's sockets on the loopback interface: nothing listens beyond this machine) and RANK/WORLD_SIZE/LOCAL_RANK
    set. `fn` must be importable (module level) and its result
    picklable. If a rank fails, LaunchError names the rank whose own error started it, with that
    traceback: errors that only report another rank's failure ("rank N rejected ...", "stopping
    because rank N failed") rank after it, waiting up to `grace_s` for the rank they blame. Then
    the others are killed; after a timeout every rank is killed. No process outlives the call.
    `start_method`: see START_METHODS (None: $DUPLEXPIPE_START_METHOD, else "forkserver"). `started` is called
    with the ranks' process ids once they run.

    The ranks cannot outlive the launcher: each ends when its parent ends (Linux's parent-death signal) and when a
    pipe only the launcher holds reaches its end (any platform: the launcher was killed, even with SIGKILL);
    SIGTERM or SIGHUP to the launcher (in the main thread) stops the ranks, then exits with 128 + the signal.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = start_context(start_method)
    results = ctx.Queue()
    port = free_port(LOOPBACK)
    lifeline, held = ctx.Pipe(duplex=False)  # the ranks wait on `lifeline`; only this process holds `held`
    output = RankOutput()
    procs = [ctx.Process(target=_worker, args=(fn, tuple(args), r, nprocs, port, backend, results,
                                               dict(os.environ), lifeline, output.path),
                         name=f"duplexpipe-rank{r}") for r in range(nprocs)]
    previous = stop_on_signals()
    error: LaunchError | None = None
    killed = False
    try:
        for p in procs:
            p.start()
        lifeline.close()
        if started is not None:
            started([p.pid for p in procs])
        return _collect(procs, results, timeout_s, grace_s, output)
    except LaunchError as exc:
        error, killed = exc, any(p.exitcode is not None and p.exitcode < 0 for p in procs)
        raise
    finally:
        restore_signals(previous)
        lifeline.close()
        _stop(procs)
        held.close()
        results.close()
        _keep_output(output, error, killed)


def _keep_output(output: RankOutput, error: LaunchError | None, killed: bool) -> None:
    """After a failure: the ranks' output file is kept and named in the error when it holds what was not shown or a
    rank was killed; after success it is kept (and named here) only for torch's native log lines held back."""
    if error is not None:
        error.output_log = output.close(keep=killed or output.unseen() > 0)
        return
    output.relay(sys.stderr, final=True)
    kept = output.close(keep=False)
    if kept is not None:
        print(f"duplexpipe: {output.held} lines of torch's native log from the ranks are in {kept}", file=sys.stderr,
              flush=True)


def _collect(procs: Sequence[Any], results: Any, timeout_s: float | None, grace_s: float,
             output: RankOutput | None = None) -> list[Any]:
    """Wait for one result per rank, relaying the ranks' `output` meanwhile; raise LaunchError at a failure, a dead
    rank or the timeout (what the ranks write from then on stays in the output file, behind the cause)."""
    done: dict[int, Any] = {}
    errors: dict[int, Failure] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(done) < len(procs):
        if errors or _silent(procs, done, errors):
            raise _failure(procs, results, done, errors, grace_s)
        if output is not None:
            output.relay(sys.stderr)
        if not _receive(results, done, errors, 0.2):
            _expect_clean_results(procs, results, done, errors)
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r in range(len(procs)) if r not in done]
                raise LaunchError(f"launch timed out after {timeout_s:.0f}s; ranks {running} still running")
    for p in procs:
        p.join(30.0)
    return [done[r] for r in range(len(procs))]


def _receive(results: Any, done: dict[int, Any], errors: dict[int, Failure], wait_s: float) -> bool:
    """Move one report from the queue into `done` or `errors`; False when none came within `wait_s`."""
    try:
        rank, ok, value = results.get(timeout=wait_s) if wait_s > 0 else results.get_nowait()
    except queue.Empty:
        return False
    if ok:
        done[rank] = pickle.loads(value)
    else:
        errors[rank] = value if isinstance(value, Failure) else Failure(str(value), None)
    return True


def _expect_clean_results(procs: Sequence[Any], results: Any, done: dict[int, Any],
                          errors: dict[int, Failure]) -> None:
    """Read the results of ranks that exited cleanly (still in the pipe); raise for one that sent none."""
    for r, p in enumerate(procs):
        if p.exitcode != 0:
            continue
        while r not in done and r not in errors and _receive(results, done, errors, 1.0):
            pass
        if r not in done and r not in errors:
            raise LaunchError(f"rank {r} exited with code 0 without reporting a result", r)


def _silent(procs: Sequence[Any], done: dict[int, Any], errors: dict[int, Failure]) -> list[int]:
    """Ranks that exited with a failure code without reporting anything."""
    return [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done and r not in errors]


def _settled(procs: Sequence[Any], done: dict[int, Any], errors: dict[int, Failure]) -> bool:
    """True once the cause is known: some rank's own error, a rank that died silently after another lost its
    connection, or every blamed rank has exited or reported."""
    if any(f.blamed is None and not lost_a_peer(f) for f in errors.values()):
        return True
    if any(lost_a_peer(f) for f in errors.values()) and not _silent(procs, done, errors):
        return False
    blamed = {f.blamed for f in errors.values() if f.blamed is not None}
    return all(b in errors or not 0 <= b < len(procs) or procs[b].exitcode is not None for b in blamed)


def _failure(procs: Sequence[Any], results: Any, done: dict[int, Any], errors: dict[int, Failure],
             grace_s: float) -> LaunchError:
    """The LaunchError for a failed launch, after waiting up to `grace_s` for the cause to be reported.

    Order of blame: a rank that died without a report (the others then fail on a closed
    connection: a rank that lost its connection waits for it); else a rank's own error (the first
    one to arrive, closed connections last); else the first error, noting that the rank it blames
    did not report.
    """
    end = time.monotonic() + grace_s
    while not _settled(procs, done, errors) and time.monotonic() < end:
        _receive(results, done, errors, 0.05)
    while _receive(results, done, errors, 0.0):
        pass
    tracebacks = {r: f.details for r, f in errors.items()}
    own = [r for r, f in errors.items() if f.blamed is None and not lost_a_peer(f)]
    own = own or [r for r, f in errors.items() if f.blamed is None]  # no rank died silently within grace_s
    first = own[0] if own else next(iter(errors), None)
    followers = [r for r in errors if r != first]
    also = f" (then ranks {followers} stopped)" if followers else ""
    silent = _silent(procs, done, errors)
    if silent:
        dead, code = silent[0], procs[silent[0]].exitcode
        how = f"{_death(code)} without reporting a result"
        if first is None:
            return LaunchError(f"rank {dead} {how}", dead, "", tracebacks)
        # the others' errors are consequences (a closed connection, often with pages of C++ frames): one line
        # each here, their tracebacks in LaunchError.errors
        return LaunchError(f"rank {dead} {how}; then rank {first} stopped: {errors[first].summary} (every rank's "
                           "traceback: LaunchError.errors)", dead, "", tracebacks, f"rank {dead} {how}")
    assert first is not None
    if own:
        return LaunchError(f"rank {first} failed{also}:\n{errors[first].details}", first, errors[first].details,
                           tracebacks, errors[first].summary)
    return LaunchError(f"rank {first} failed, blaming rank {errors[first].blamed}, which reported no error "
                       f"within {grace_s:.0f}s{also}:\n{errors[first].details}", first, errors[first].details,
                       tracebacks, errors[first].summary)


def _death(code: int) -> str:
    """How a process ended, from its exit code: "was killed by signal 9 (SIGKILL: out of memory, or killed from
    outside)" or "exited with code 3"."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"was killed by signal {-code}"
    why = ": out of memory, or killed from outside" if name == "SIGKILL" else ""
    return f"was killed by signal {-code} ({name}{why})"


def run(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    backend: str | None = None,
    timeout_s: float | None = None,
    start_method: str | None = None,
    comm_timeout_s: float = 300.0,
    started: Callable[[list[int]], None] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on every rank: in place under torchrun, else in `nprocs` local processes
    (started with `start_method`, see `launch`).

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) this process is one rank:
    the group is initialised from the environment (`init_from_env`, waits bounded by `comm_timeout_s`;
    restarted attempts meet on their own keys) and the list holds only this rank's result; a
    failure is settled with the other ranks for torchrun's summary (`failures.record_failure`): the rank
    whose own error it is raises it; a rank that only stopped because of it raises StoppedByPeer, having
    logged one line. The backend defaults to NCCL when there is a GPU for every local process, else gloo;
    the choice is logged. `started`: see `launch` (not called under torchrun, whose agent owns the processes).
    """
    if launched_by_torchrun():
        backend = backend or default_backend()
        _log_backend(backend, int(os.environ["WORLD_SIZE"]), "under torchrun")
        init_from_env(backend, comm_timeout_s)
        try:
            result = [fn(*args)]
        except BaseException as exc:
            rank = int(os.environ["RANK"])
            settled = record_failure(exc, rank, int(os.environ["WORLD_SIZE"]))
            shutdown(clean=False)
            if settled.cause is not None:
                raise StoppedByPeer(rank, settled.cause, settled.same_node) from exc
            raise
        shutdown(clean=True)
        return result
    backend = backend or default_backend(nprocs)
    _log_backend(backend, nprocs, "on this machine")
    return launch(fn, nprocs, args, backend=backend, timeout_s=timeout_s, start_method=start_method, started=started)
