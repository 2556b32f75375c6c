"""Process spawning, step timing and summary statistics shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from duplexpipe.launch.processes import cuda_device_for, start_context

WorkerFn = Callable[[int, int, Any], Any]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world: int, port: int, fn: WorkerFn, arg: Any, queue: Any, backend: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(cuda_device_for(rank))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        result = fn(rank, world, arg)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - the parent reports the traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: WorkerFn, arg: Any, world: int, timeout_s: float, backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world, arg)` in `world` gloo (or NCCL, a GPU each) processes; return the results by rank.

    Raises RuntimeError with the first traceback when a rank fails, and TimeoutError
    (after killing the processes it started) when they run past `timeout_s`.
    """
    ctx = start_context()  # forkserver unless $DUPLEXPIPE_START_METHOD says otherwise: torch imported once
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, arg, queue, backend), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} ran past {timeout_s:.0f} s "
                                   f"(ranks done: {sorted(results)})")
            try:
                rank, status, payload = queue.get(timeout=min(left, 1.0))
            except Exception:  # noqa: BLE001 - queue.Empty: poll again
                if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                    codes = [p.exitcode for p in procs]
                    raise RuntimeError(f"a worker died without a result, exit codes {codes}") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return [results[r] for r in range(world)]


def timed(step: Callable[[], Any], group: Any = None) -> tuple[float, Any]:
    """Run one step between barriers; return (slowest rank's seconds, step's result)."""
    dist.barrier(group=group)
    start = time.perf_counter()
    out = step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item()), out


def timed_cpu(step: Callable[[], Any], group: Any = None) -> tuple[float, float, Any]:
    """Like `timed`, plus the CPU seconds the step took summed over the ranks (each process's CPU time,
    its communication threads included): what the ranks cost together when they share cores."""
    dist.barrier(group=group)
    start, cpu = time.perf_counter(), time.process_time()
    out = step()
    spent = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64)
    wall = spent[:1].clone()
    dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=group)
    total = spent[1:].clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return float(wall.item()), float(total.item()), out


@dataclass(frozen=True)
class Stats:
    """Summary of repeated timings in seconds."""

    median: float
    """The median sample."""
    q1: float
    """The lower quartile."""
    q3: float
    """The upper quartile."""
    n: int
    """How many samples."""

    def to_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3, "n": self.n}


def summarize(samples: list[float]) -> Stats:
    """Median and quartiles of `samples` (raises ValueError when empty)."""
    if not samples:
        raise ValueError("summarize needs at least one sample, got none")
    ordered = sorted(samples)
    if len(ordered) < 4:
        return Stats(statistics.median(ordered), ordered[0], ordered[-1], len(ordered))
    q1, _, q3 = statistics.quantiles(ordered, n=4)
    return Stats(statistics.median(ordered), q1, q3, len(ordered))


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_1_5_15": [round(x, 2) for x in load],
    }


def uptime() -> str:
    """The `uptime` command's line (how loaded the machine is), or "?" where it cannot run."""
    import subprocess

    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip() or "?"
    except OSError:
        return "?"
