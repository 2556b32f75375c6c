"""Ranks, step timing, round-robin stepping, summary statistics, and the one GPT training harness of the parts."""

from __future__ import annotations

import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from benchmarks.internals import SHARE_GPU_ENV
from duplexpipe import Pipeline, PipelineConfig, make_mesh
from duplexpipe import run as run_ranks  # `duplexpipe.launch` (the function) is shadowed by its subpackage
from duplexpipe.launch.tasks.gpt import gpt_task
from duplexpipe.runtime.backend import default_device

P = TypeVar("P")
WorkerFn = Callable[[int, int, Any], Any]


def spawn(fn: WorkerFn, arg: Any, world: int, timeout_s: float, backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world, arg)` on `world` local ranks (`duplexpipe.run`, gloo or NCCL); the results by rank."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend nccl needs a CUDA GPU")
    if backend == "nccl" and torch.cuda.device_count() < world:
        os.environ[SHARE_GPU_ENV] = "1"
    return run_ranks(_call, world, (fn, arg), backend=backend, timeout_s=timeout_s)


def _call(fn: WorkerFn, arg: Any) -> Any:
    torch.set_num_threads(1)
    return fn(dist.get_rank(), dist.get_world_size(), arg)


@dataclass
class Trace:
    """One stepper's record in a round-robin run, measured steps only."""

    wall: list[float] = field(default_factory=list)  # each step's seconds on the slowest rank
    cpu: list[float] = field(default_factory=list)  # each step's CPU seconds on this rank
    out: list[Any] = field(default_factory=list)  # what each step returned
    extra: list[Any] = field(default_factory=list)  # what `extra` read after each step


@dataclass(frozen=True)
class RoundRobin(Generic[P]):
    """Steppers trained in turn (the first one rotating), so all see the same load; each step timed between barriers."""

    steppers: Sequence[P]  # anything `step` can step (Pipelines, runtimes, torch pipes)
    step: Callable[[P, int], Any]  # (stepper, step index) -> the step's output
    extra: Callable[[P], Any] | None = None  # read after each measured step, on every rank (may be a collective)
    cpu_timer: Callable[[], float] = time.process_time  # this process's CPU seconds (read before and after each step)

    def run(self, steps: int, warmup: int = 0) -> list[Trace]:
        """`warmup` unmeasured then `steps` measured rounds; a Trace per stepper."""
        traces = [Trace() for _ in self.steppers]
        n = len(self.steppers)
        for i in range(warmup + steps):
            for c in ((i + k) % n for k in range(n)):
                dist.barrier()
                start, cpu = time.perf_counter(), self.cpu_timer()
                out = self.step(self.steppers[c], i)
                cpu = self.cpu_timer() - cpu
                wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=default_device())
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank's seconds (on the GPU under NCCL)
                if i >= warmup:
                    trace = traces[c]
                    trace.wall.append(float(wall.item()))
                    trace.cpu.append(cpu)
                    trace.out.append(out)
                    if self.extra is not None:
                        trace.extra.append(self.extra(self.steppers[c]))
        return traces


class ScriptedStepClock:
    """A CPU timer for `RoundRobin` that stands still except inside steps: each step of stepper c takes costs[c]
    seconds (RoundRobin reads it before and after each step, the first stepper rotating). A deterministic CPU time
    for calibrations under test."""

    def __init__(self, costs: Sequence[float]) -> None:
        self.costs, self.reads, self.now = list(costs), 0, 0.0

    def __call__(self) -> float:
        pair, end = divmod(self.reads, 2)
        if end:
            step, k = divmod(pair, len(self.costs))
            self.now += self.costs[(step + k) % len(self.costs)]
        self.reads += 1
        return self.now


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per step, the largest of the ranks' values."""
    return [max(values) for values in zip(*per_rank, strict=True)]


@dataclass(frozen=True)
class Stats:
    """Summary of repeated timings in seconds."""

    median: float  # the median sample
    q1: float  # the lower quartile
    q3: float  # the upper quartile
    n: int  # how many samples

    def to_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3, "n": self.n}


def summarize(samples: Sequence[float]) -> Stats:
    """Median and quartiles of `samples` (raises ValueError when empty)."""
    if not samples:
        raise ValueError("summarize needs at least one sample, got none")
    ordered = sorted(samples)
    q1, q3 = (ordered[0], ordered[-1]) if len(ordered) < 4 else statistics.quantiles(ordered, n=4)[::2]
    return Stats(statistics.median(ordered), q1, q3, len(ordered))


def quantile(values: Sequence[float], q: float) -> float:
    """The sample at fraction `q` of `values` sorted (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def paired_ratio(num: Sequence[float], den: Sequence[float], draws: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
    """The median over rounds of num / den (each round's pair measured side by side, so a disturbance that falls on
    the whole round cancels) and its percentile-bootstrap interval at `level` (rounds resampled): (median, low,
    high)."""
    ratios = [n / d for n, d in zip(num, den, strict=True)]
    if not ratios:
        raise ValueError("paired_ratio needs at least one round, got none")
    rng = random.Random(seed)
    drawn = [statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws)]
    tail = (1.0 - level) / 2
    return statistics.median(ratios), quantile(drawn, tail), quantile(drawn, 1.0 - tail)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    info = Path("/proc/cpuinfo").read_text(encoding="utf-8") if os.path.exists("/proc/cpuinfo") else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
               platform.processor() or "")
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def uptime() -> str:
    """The `uptime` command's line (how loaded the machine is), or "?" where it cannot run."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


Optimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def adamw(lr: float = 3e-3) -> Optimizer:
    """The example's optimizer: AdamW, weight decay 0.01."""
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def sgd(lr: float, momentum: float) -> Optimizer:
    """Plain SGD."""
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def gpt(n_layer: int = 4, d_model: int = 64) -> Any:
    """The demo task (`duplexpipe.launch.tasks.gpt`): the GPT's blocks, embedding, head, loss and batches."""
    torch.manual_seed(0)
    return gpt_task(n_layer=n_layer, d_model=d_model)


def gpt_pipeline(task: Any, config: PipelineConfig, optimizer: Optimizer | None = None, pp: int = 0,
                 dp: int = 1) -> Pipeline:
    """The task's model as a Pipeline (over a pp x dp mesh when `pp` is given, else every rank a stage)."""
    return Pipeline.from_layers(task.layers, task.loss_fn, optimizer or adamw(), config, embedding=task.embedding,
                                head=task.head, mesh=make_mesh(pp, dp) if pp else None)


def gpt_step(task: Any, batch_size: int) -> Callable[[Pipeline, int], float]:
    """A RoundRobin step: the task's batch of that step, this data-parallel replica's share of it."""
    def step(pipe: Pipeline, i: int) -> float:
        x, y = task.batch(i, batch_size)
        share = x.shape[0] // pipe.groups.dp_size
        lo = pipe.groups.dp_rank * share
        return pipe.step(x[lo:lo + share], y[lo:lo + share])
    return step
