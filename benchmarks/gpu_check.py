"""The GPU figures in one prepared command: overhead, compile, float8, memory levers, CUDA tests (--dry-run: CPU)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import harness, moe_overlap
from duplexpipe import Pipeline, PipelineConfig
from duplexpipe.launch.tasks.gpt import CharCorpus, gpt_task
from duplexpipe.train.compile import compile_targets
from duplexpipe.train.pipeline_config import DataParallelConfig, ObserveConfig, PrecisionConfig, SafetyConfig

ROOT = Path(__file__).resolve().parents[1]
DEVICE_MINUTES = 8.0
"""The device time the whole GPU run must fit in (the sum of the parts' budgets stays under it)."""
PEAK_BF16_FLOPS = MappingProxyType({"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12})
"""Dense bf16 peak FLOP/s by card (first name contained in the device's name wins); other cards: no MFU."""
FLOAT8_NAMES = ("fp8", "float8", "float8_e4m3fn")
"""The PrecisionConfig.dtype names a landed float8 option may take (checked at run time)."""


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the GPT example's shape, the steps, the precision, the backend, each part's budget."""

    layers: int
    width: int
    seq: int
    heads: int
    microbatch: int  # sequences per microbatch
    microbatches: int  # M of the 1F1B run and the plain loop's accumulation
    steps: int  # measured rounds (each stepper once per round, alternating)
    warmup: int  # unmeasured rounds before
    dtype: str  # PrecisionConfig.dtype ("bf16" on CUDA)
    backend: str  # "nccl" or "gloo"
    compile_backend: str  # torch.compile backend of part 2
    memory_steps: int  # rounds of part 4
    pytest_paths: tuple[str, ...]  # what `pytest -m cuda` collects
    moe: moe_overlap.MoEBenchConfig  # the MoE pair (two ranks)
    budgets: dict[str, float] = field(default_factory=dict)  # seconds per part (a deadline checked between steps)
    expected: dict[str, float] = field(default_factory=dict)  # seconds each part is expected to take


PARTS = ("overhead", "compile", "float8", "memory", "cuda")
"""The parts in the order they run."""

GPU = Sizes(layers=12, width=1024, seq=1024, heads=16, microbatch=4, microbatches=8, steps=10, warmup=3, dtype="bf16",
            backend="nccl", compile_backend="inductor", memory_steps=3, pytest_paths=("tests",),
            moe=moe_overlap.MoEBenchConfig(backend="nccl", ranks=2, steps=0),
            budgets={"overhead": 60, "compile": 130, "float8": 40, "memory": 100, "cuda": 120},
            expected={"overhead": 40, "compile": 100, "float8": 30, "memory": 75, "cuda": 90})
DRY = Sizes(layers=2, width=64, seq=32, heads=4, microbatch=1, microbatches=8, steps=2, warmup=0, dtype="fp32",
            backend="gloo", compile_backend="eager", memory_steps=2,
            pytest_paths=("tests/runtime/test_watchdog_cuda.py",),
            moe=replace(moe_overlap.QUICK, ranks=2, steps=0),
            budgets={"overhead": 20, "compile": 30, "float8": 15, "memory": 30, "cuda": 30},
            expected={"overhead": 5, "compile": 5, "float8": 0, "memory": 12, "cuda": 12})


class BudgetExceeded(RuntimeError):
    """A part ran past its time budget (checked between steps)."""


def device_info() -> dict[str, Any]:
    """The GPU's name, torch's, CUDA's and NCCL's versions; on CPU "cpu", torch's version and None."""
    if not torch.cuda.is_available():
        return {"gpu": "cpu", "torch": torch.__version__, "cuda": None, "nccl": None, "gpus": 0}
    nccl = torch.cuda.nccl.version()
    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            "gpus": torch.cuda.device_count()}


def peak_flops(gpu: str) -> float | None:
    """The card's dense bf16 peak FLOP/s, or None for a card not in PEAK_BF16_FLOPS (and the CPU)."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in gpu), None)


def step_flops(sizes: Sizes, params: int) -> float:
    """A training step's FLOPs: 6 x params x tokens, plus attention's 12 x layers x width x seq per token."""
    tokens = sizes.microbatch * sizes.microbatches * sizes.seq
    return 6.0 * params * tokens + 12.0 * sizes.layers * sizes.width * sizes.seq * tokens


def plan(sizes: Sizes) -> str:
    """The run's plan: the parts, the sizes, the expected and budgeted seconds of each and in total."""
    shape = (f"GPT {sizes.layers} layers, width {sizes.width}, seq {sizes.seq}, {sizes.microbatches} microbatches "
             f"of {sizes.microbatch}, {sizes.dtype}, {sizes.backend}, {sizes.warmup}+{sizes.steps} steps")
    what = {"overhead": f"P=1 1F1B M={sizes.microbatches} vs plain accumulation loop, alternating: {shape}",
            "compile": f"compiled/eager ({sizes.compile_backend}) of the pipeline vs of the plain loop, same model",
            "float8": f"float8/{sizes.dtype} tokens/s if PrecisionConfig accepts a float8 dtype, else 'not landed'",
            "memory": f"checkpointing full vs selective, offload off vs on at P=2; ZeRO-2 vs ZeRO-3 (window 1, all) "
                      f"at P=1 x D=2 (P=2 x D=2 with 4 GPUs); ranks share one GPU; {sizes.memory_steps} steps each",
            "cuda": f"pytest -m cuda {' '.join(sizes.pytest_paths)}; MoE F&B pair on {sizes.moe.backend}, 2 ranks "
                    "(sharing the GPU on NCCL)"}
    lines = ["plan:"]
    for name in PARTS:
        lines.append(f"  {name:9s} expect {sizes.expected[name]:4.0f} s, budget {sizes.budgets[name]:4.0f} s: "
                     f"{what[name]}")
    lines.append(f"  total     expect {sum(sizes.expected.values()):4.0f} s, budget {sum(sizes.budgets.values()):4.0f}"
                 f" s (device time limit {DEVICE_MINUTES * 60:.0f} s)")
    return "\n".join(lines)


# --- inside the ranks ----------------------------------------------------------------------------------------------


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def check_deadline(deadline: float, what: str) -> None:
    """BudgetExceeded on every rank (a collective decision) once any rank is past `deadline` (time.time())."""
    late = torch.tensor([float(time.time() > deadline)], device=_device())
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    if late.item():
        raise BudgetExceeded(f"the part's budget ran out before {what}")


def _task(sizes: Sizes) -> Any:
    torch.manual_seed(0)
    return gpt_task(n_layer=sizes.layers, d_model=sizes.width, n_head=sizes.heads, block_size=sizes.seq)


def _config(sizes: Sizes, dtype: str | None = None, **kwargs: Any) -> PipelineConfig:
    return PipelineConfig("1f1b", sizes.microbatches, precision=PrecisionConfig(dtype or sizes.dtype),
                          safety=SafetyConfig(check_inputs_every_step=False),
                          observe=kwargs.pop("observe", ObserveConfig(record_timeline=False)), **kwargs)


def _pipeline(sizes: Sizes, dtype: str | None = None, pp: int = 0, dp: int = 1, **kwargs: Any) -> Pipeline:
    return harness.gpt_pipeline(_task(sizes), _config(sizes, dtype, **kwargs), harness.adamw(1e-4), pp, dp)


Stepper = tuple[Any, Callable[[Any, int], float]]


def _batches(sizes: Sizes) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """The task's batches (step, size) from the corpus alone: no model built for them."""
    corpus = CharCorpus()
    return lambda step, size: corpus.batch(step, size, sizes.seq, seed=0)


def _pipe_stepper(sizes: Sizes, pipe: Pipeline) -> Stepper:
    batch, device = _batches(sizes), _device()

    def step(p: Pipeline, i: int) -> float:
        x, y = batch(i, sizes.microbatch * sizes.microbatches * p.groups.dp_size)  # M microbatches a replica
        share = x.shape[0] // p.groups.dp_size
        lo = p.groups.dp_rank * share
        return p.step(x[lo:lo + share].to(device), y[lo:lo + share].to(device))
    return pipe, step


def _plain_stepper(sizes: Sizes, compiled: bool = False) -> Stepper:
    """The same model as one nn.Sequential on this rank's device, the same microbatches accumulated (autocast as the
    pipeline's precision; its blocks compiled as the pipeline compiles them)."""
    task, device = _task(sizes), _device()
    net = nn.Sequential(task.embedding, *task.layers, task.head).to(device)
    if compiled:
        for layer in task.layers:
            for block, _ in compile_targets(layer):
                block.compile(backend=sizes.compile_backend)
    optimizer = harness.adamw(1e-4)(list(net.parameters()))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(sizes.dtype)

    def step(_: Any, i: int) -> float:
        x, y = task.batch(i, sizes.microbatch * sizes.microbatches)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for lo in range(0, x.shape[0], sizes.microbatch):
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = task.loss_fn(net(x[lo:lo + sizes.microbatch]), y[lo:lo + sizes.microbatch])
            (loss / sizes.microbatches).backward()
            total += float(loss.detach()) / sizes.microbatches
        optimizer.step()
        return total
    return None, step


def alternate(steppers: Sequence[Stepper], sizes: Sizes, deadline: float, steps: int | None = None,
              warmup: int | None = None) -> list[list[float]]:
    """Each stepper once a round, the first one rotating (all see the same load), `warmup` rounds unmeasured; per
    stepper, each measured step's seconds on the slowest rank, from a synchronized device to a synchronized device.
    The deadline is checked (collectively) before each round, outside the timing."""
    steps, warmup = sizes.steps if steps is None else steps, sizes.warmup if warmup is None else warmup
    device, n = _device(), len(steppers)
    walls: list[list[float]] = [[] for _ in steppers]
    for i in range(warmup + steps):
        check_deadline(deadline, f"round {i} of {warmup + steps}")
        for c in ((i + k) % n for k in range(n)):
            _sync()
            dist.barrier()
            start = time.perf_counter()
            stepper, step = steppers[c]
            step(stepper, i)
            _sync()
            wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank's seconds (a device tensor: NCCL too)
            if i >= warmup:
                walls[c].append(float(wall.item()))
    return walls


def _sync() -> None:
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def _ratio(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    median, low, high = harness.paired_ratio(num, den)
    return {"ratio": median, "low": low, "high": high}


def overhead_worker(rank: int, world: int, job: tuple[Sizes, float]) -> dict[str, Any]:
    """Part 1 on one rank: the pipeline and the plain loop alternating; step seconds, the ratio, tokens/s."""
    sizes, deadline = job
    pipe = _pipeline(sizes)
    params = sum(p.numel() for m in pipe.stage_modules.values() for p in m.parameters())
    ours, plain = alternate([_pipe_stepper(sizes, pipe), _plain_stepper(sizes)], sizes, deadline)
    tokens = sizes.microbatch * sizes.microbatches * sizes.seq
    return {"params": params, "ours_s": harness.summarize(ours).to_dict(),
            "plain_s": harness.summarize(plain).to_dict(), "ours_over_plain": _ratio(ours, plain),
            "tokens_per_s": tokens / harness.summarize(ours).median,
            "plain_tokens_per_s": tokens / harness.summarize(plain).median, "step_flops": step_flops(sizes, params)}


def compile_worker(rank: int, world: int, job: tuple[Sizes, float]) -> dict[str, Any]:
    """Part 2 on one rank: eager and compiled, of the pipeline and of the plain loop, alternating."""
    sizes, deadline = job
    steppers = [_pipe_stepper(sizes, _pipeline(sizes)),
                _pipe_stepper(sizes, _pipeline(sizes, compile={"backend": sizes.compile_backend})),
                _plain_stepper(sizes), _plain_stepper(sizes, compiled=True)]
    pipe_eager, pipe_compiled, plain_eager, plain_compiled = alternate(
        steppers, sizes, deadline, warmup=max(sizes.warmup, 1))  # the first step compiles: never measured
    pipe, plain = _ratio(pipe_compiled, pipe_eager), _ratio(plain_compiled, plain_eager)
    return {"pipeline_compiled_over_eager": pipe, "plain_compiled_over_eager": plain,
            "gain_kept": (1 - pipe["ratio"]) / (1 - plain["ratio"]) if plain["ratio"] != 1 else None,
            "backend": sizes.compile_backend}


def float8_name() -> str | None:
    """The float8 dtype name PrecisionConfig accepts, or None while float8 has not landed."""
    for name in FLOAT8_NAMES:
        try:
            PrecisionConfig(name)
        except (ValueError, TypeError):
            continue
        return name
    return None


def float8_worker(rank: int, world: int, job: tuple[Sizes, float, str]) -> dict[str, Any]:
    """Part 3 on one rank: the pipeline at float8 and at the run's dtype, alternating; tokens/s of each."""
    sizes, deadline, name = job
    fp8, base = alternate([_pipe_stepper(sizes, _pipeline(sizes, name)), _pipe_stepper(sizes, _pipeline(sizes))],
                          sizes, deadline)
    tokens = sizes.microbatch * sizes.microbatches * sizes.seq
    return {"float8_tokens_per_s": tokens / harness.summarize(fp8).median,
            "base_tokens_per_s": tokens / harness.summarize(base).median,
            "float8_over_base_speed": _ratio(base, fp8), "dtype": name}


MEMORY_VARIANTS: Mapping[str, tuple[str, dict[str, Any]]] = MappingProxyType({
    "ZeRO-2": ("zero", {"data_parallel": DataParallelConfig(zero_stage=2)}),
    "ZeRO-3, window 1": ("zero", {"data_parallel": DataParallelConfig(zero_stage=3, reshard_window=1)}),
    "ZeRO-3, window all": ("zero", {"data_parallel": DataParallelConfig(zero_stage=3, reshard_window=None)}),
    "checkpointing full": ("pp", {"activation_checkpointing": "full"}),
    "checkpointing selective": ("pp", {"activation_checkpointing": "selective"}),
    "offload off": ("pp", {"activation_offload": False}),
    "offload on": ("pp", {"activation_offload": True}),
})
"""Part 4's variants: the mesh group each runs in ("zero": data-parallel, "pp": P=2) and its config fields."""


def zero_mesh(world: int) -> tuple[int, int]:
    """The (P, D) mesh of the ZeRO comparison: P=2 x D=2 where the world allows 4 ranks, else P=1 x D=2."""
    return (2, 2) if world >= 4 else (1, 2)


def memory_worker(rank: int, world: int, job: tuple[Sizes, float, str, tuple[int, int]]) -> dict[str, Any]:
    """Part 4 on one rank: one group's variants alternating, measuring memory; peak bytes and step seconds."""
    sizes, deadline, group, (pp, dp) = job
    names = [n for n, (g, _) in MEMORY_VARIANTS.items() if g == group]
    pipes = [_pipeline(sizes, pp=pp, dp=dp, observe=ObserveConfig(record_timeline=False, measure_memory=True),
                       **MEMORY_VARIANTS[n][1]) for n in names]
    walls = alternate([_pipe_stepper(sizes, p) for p in pipes], sizes, deadline, steps=sizes.memory_steps, warmup=0)
    out: dict[str, Any] = {}
    for name, pipe, wall in zip(names, pipes, walls, strict=True):
        memory = pipe.last.memory if pipe.last is not None else None
        if memory is None:
            raise RuntimeError(f"{name}: no measured memory after the step")
        report = {k: v for k, v in memory.to_dict().items() if k != "curve"}
        out[name] = {"memory": report, "step_s": harness.summarize(wall).to_dict(), "mesh": [pp, dp]}
    return out


# --- the parts, in this process ------------------------------------------------------------------------------------


Runner = Callable[[Sizes, float], dict[str, Any]]


def _spawn(fn: harness.WorkerFn, job: Any, world: int, sizes: Sizes, deadline: float) -> list[Any]:
    """`fn` on `world` ranks, killed at the part's deadline (the ranks stop themselves a little before)."""
    return harness.spawn(fn, job, world, max(1.0, deadline - time.time()), backend=sizes.backend)


def _soft(deadline: float, start: float) -> float:
    return deadline - 0.15 * (deadline - start)  # the ranks' own deadline: room left to return and exit


def run_overhead(sizes: Sizes, deadline: float) -> dict[str, Any]:
    """Part 1: ours/plain, tokens/s, MFU."""
    out: dict[str, Any] = _spawn(overhead_worker, (sizes, _soft(deadline, time.time())), 1, sizes, deadline)[0]
    peak = peak_flops(device_info()["gpu"])
    out["peak_flops"] = peak
    out["mfu"] = out["step_flops"] / out["ours_s"]["median_s"] / peak if peak else None
    out["plain_mfu"] = out["step_flops"] / out["plain_s"]["median_s"] / peak if peak else None
    return out


def run_compile(sizes: Sizes, deadline: float) -> dict[str, Any]:
    """Part 2: compiled/eager of the pipeline against that of the plain loop."""
    result: dict[str, Any] = _spawn(compile_worker, (sizes, _soft(deadline, time.time())), 1, sizes, deadline)[0]
    return result


def run_float8(sizes: Sizes, deadline: float) -> dict[str, Any]:
    """Part 3: float8/base tokens/s, or the reason it is not measured."""
    name = float8_name()
    if name is None:
        return {"status": "not landed", "reason": f"PrecisionConfig accepts none of {', '.join(FLOAT8_NAMES)} "
                "(issue 44 not done)"}
    result: dict[str, Any] = _spawn(float8_worker, (sizes, _soft(deadline, time.time()), name), 1, sizes, deadline)[0]
    return result


def run_memory(sizes: Sizes, deadline: float) -> dict[str, Any]:
    """Part 4: each variant's measured peak bytes and step seconds, per mesh group (processes share the GPU)."""
    gpus = torch.cuda.device_count() if sizes.backend == "nccl" else 0
    zero = zero_mesh(4 if gpus >= 4 else 2)
    out: dict[str, Any] = {"variants": {}, "shared_gpu": sizes.backend == "nccl" and gpus < 2,
                           "note": "step times measured with measure_memory on; ranks share one GPU where it is the "
                                   "only one"}
    for group, mesh in (("pp", (2, 1)), ("zero", zero)):
        world = mesh[0] * mesh[1]
        ranks = _spawn(memory_worker, (sizes, _soft(deadline, time.time()), group, mesh), world, sizes, deadline)
        for name, row in ranks[0].items():
            row["max_total_peak"] = max(r[name]["memory"]["total_peak"] for r in ranks)
            row["ranks"] = world
            out["variants"][name] = row
    return out


def run_cuda(sizes: Sizes, deadline: float) -> dict[str, Any]:
    """Part 5: `pytest -m cuda` as a subprocess with a timeout, then the MoE F&B pair on two ranks."""
    out: dict[str, Any] = {}
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *sizes.pytest_paths]
    pytest_deadline = time.time() + 0.6 * (deadline - time.time())
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(1.0, pytest_deadline - time.time()))
        tail = done.stdout.strip().splitlines()[-1:] or [""]
        out["pytest"] = {"rc": done.returncode, "summary": tail[0], "counts": _counts(tail[0])}
    except subprocess.TimeoutExpired:
        out["pytest"] = {"rc": None, "summary": "timed out", "counts": {}}
    moe = replace(sizes.moe, ranks=2, steps=0)
    ranks = _spawn(moe_overlap.worker, moe, 2, sizes, deadline)
    out["moe_pair"] = {**moe_overlap.summary(ranks), "backend": moe.backend,
                       "shared_gpu": moe.backend == "nccl" and torch.cuda.device_count() < 2}
    return out


def _counts(summary: str) -> dict[str, int]:
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", summary)}


RUNNERS: Mapping[str, Runner] = MappingProxyType({"overhead": run_overhead, "compile": run_compile,
                                                  "float8": run_float8, "memory": run_memory, "cuda": run_cuda})


def run_parts(sizes: Sizes, runners: Mapping[str, Runner]) -> dict[str, dict[str, Any]]:
    """Each part guarded: its figures (status "ok"), its own status and reason, or the exception that stopped it."""
    parts: dict[str, dict[str, Any]] = {}
    for name, runner in runners.items():
        start = time.time()
        budget = sizes.budgets.get(name, 60.0)
        print(f"[{name}: budget {budget:.0f} s]", flush=True)
        try:
            figures = runner(sizes, start + budget)
            status = figures.pop("status", "ok")
            entry: dict[str, Any] = {"status": status, "figures": figures}
            if "reason" in figures:
                entry["reason"] = figures.pop("reason")
        except Exception as exc:  # noqa: BLE001 - one broken part must not lose the others' figures
            entry = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(f"[{name} FAILED] {entry['reason']}", file=sys.stderr, flush=True)
        entry.update(seconds=time.time() - start, budget_s=budget)
        parts[name] = entry
        print(f"[{name}: {entry['status']}, {entry['seconds']:.1f} s]", flush=True)
    return parts


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def headline(name: str, entry: dict[str, Any]) -> str:
    """A part's figures in one cell."""
    f = entry.get("figures", {})
    if entry["status"] != "ok":
        lines = [line.strip() for line in entry.get("reason", "").splitlines() if line.strip()]
        return lines[-1] if lines else ""  # a launch error's own message comes last, after the rank's traceback
    if name == "overhead":
        r = f["ours_over_plain"]
        return (f"ours/plain {r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}], {f['tokens_per_s']:.0f} tokens/s, "
                f"MFU {_fmt(f['mfu'])}")
    if name == "compile":
        return (f"compiled/eager: pipeline {f['pipeline_compiled_over_eager']['ratio']:.3f}, plain "
                f"{f['plain_compiled_over_eager']['ratio']:.3f}")
    if name == "float8":
        return f"float8/base speed {f['float8_over_base_speed']['ratio']:.3f}"
    if name == "memory":
        return "; ".join(f"{k}: {v['max_total_peak'] / 2**20:.1f} MiB, {v['step_s']['median_s'] * 1e3:.0f} ms"
                         for k, v in f["variants"].items()) + (" (ranks share one GPU)" if f["shared_gpu"] else "")
    if name == "cuda":
        return (f"pytest -m cuda: {f['pytest']['summary']}; MoE pair overlapped/sequential "
                f"{f['moe_pair']['pair_ratio']:.3f} ({f['moe_pair']['backend']}, 2 ranks"
                f"{', sharing one GPU' if f['moe_pair']['shared_gpu'] else ''})")
    return json.dumps(f)[:200]


def markdown(result: dict[str, Any]) -> str:
    """The device line and one row per part."""
    d = result["device"]
    lines = [f"GPU {d['gpu']}, torch {d['torch']}, CUDA {d['cuda']}, NCCL {d['nccl']}"
             f"{' (dry run on CPU)' if result['dry_run'] else ''}", "",
             "| part | status | seconds (budget) | figures |", "|---|---|---|---|"]
    for name, entry in result["parts"].items():
        cell = headline(name, entry).replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {entry['status']} | {entry['seconds']:.0f} ({entry['budget_s']:.0f}) | {cell} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None, runners: Mapping[str, Runner] | None = None) -> int:
    """`python -m benchmarks.gpu_check [--dry-run] [--out DIR]`: the plan, the parts, gpu_check.json and .md."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="every part on CPU with tiny sizes (gloo, fp32)")
    parser.add_argument("--out", default=str(ROOT / "bench-output"), help="folder of gpu_check.json and gpu_check.md")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU: run with --dry-run")
    sizes = DRY if args.dry_run else GPU
    if args.dry_run:  # what a lent GPU will run, then what this dry run runs through the same code paths
        print("the GPU run's " + plan(GPU) + "\nthis dry run's " + plan(DRY), flush=True)
    else:
        print(plan(GPU), flush=True)
    started = time.time()
    parts = run_parts(sizes, RUNNERS if runners is None else runners)
    result = {"device": device_info(), "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
              "command": "python -m benchmarks.gpu_check" + (" --dry-run" if args.dry_run else ""),
              "seconds": time.time() - started, "sizes": asdict(sizes), "parts": parts}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    table = markdown(result)
    (out / "gpu_check.md").write_text(table, encoding="utf-8")
    print(table, flush=True)
    return 0 if all(p["status"] != "failed" for p in parts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
