"""Part: compiled stages: how much of torch.compile's gain a pipeline keeps (1F1B, ZB-H1), the split-backward designs,
and the first step's compile time with a cold and a warm cache."""

from __future__ import annotations

import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import harness
from benchmarks.framework import Block, Part, Result, met, ms
from benchmarks.runner import main
from duplexpipe import Pipeline, PipelineConfig
from duplexpipe.launch.tasks.gpt import gpt_task
from duplexpipe.train.compile import compile_targets
from duplexpipe.train.pipeline_config import ObserveConfig

MODELS = ("gpt", "llama")
"""The bundled GPT example, and a transformers Llama (random weights) the project was not written for."""
KEPT = 0.9
"""The least share of compile's one-process saving a pipeline keeps (1F1B and ZB-H1)."""
MIN_SAVING = 0.05
"""A plain-loop saving below this is too small to judge what share a pipeline keeps."""
RESTART_STEPS = 6
"""Steps of each fresh process timed after a restart: the first (it compiles or loads the cache), then the rest."""
DRAWS = 2000
"""Bootstrap resamples of the rounds behind each interval."""
LEVEL = 0.95
"""The intervals' coverage (percentile bootstrap)."""
RUNS = ("plain eager", "plain compiled", "1f1b eager", "1f1b compiled", "zb-h1 eager", "zb-h1 compiled")
"""What every model times in each round (designs add the GPT's split-backward variants)."""


@dataclass(frozen=True)
class CompileBenchConfig:
    """Each model's blocks compiled with `backend` (PipelineConfig.compile) in a pipeline on `ranks` processes (1F1B
    and ZB-H1) and in a plain one-process training loop of the same blocks on every rank (the same microbatch shape,
    gradients accumulated over this rank's share of the batch: a pipeline rank's work), eager and compiled, all
    stepping in turn round by round, so a disturbance of the shared machine falls on all alike. The designs of the
    split backward on ZB-H1 and DualPipeV (GPT): two graphs (the chosen), the whole region at I (what parts the user
    compiled get), and the weight matmuls kept out of the compiled regions. The first step's time in fresh
    processes, with an empty and with the same inductor cache."""

    models: tuple[str, ...] = MODELS
    layers: int = 4  # transformer blocks
    dim: int = 256  # model width
    seq: int = 128  # tokens per sequence
    batch: int = 8  # sequences per step
    microbatches: int = 2  # per step (= ranks: the largest bubble); the plain loop runs microbatches / ranks
    backend: str = "inductor"
    warmup: int = 3  # untimed rounds (the first compiles)
    rounds: int = 40  # timed rounds: each run steps once per round, in a rotating order
    designs: bool = False  # also time the split-backward designs (GPT; DualPipeV with at least 2 x ranks microbatches)
    restarts: tuple[str, ...] = ("zb-h1",)  # schedules whose first step is timed cold and warm; () for none
    ranks: int = 2


QUICK = CompileBenchConfig(models=("gpt",), layers=4, dim=32, seq=16, batch=8, microbatches=4, warmup=2, rounds=4,
                           designs=True)


def _gpt(cfg: CompileBenchConfig) -> Any:
    torch.manual_seed(0)
    return gpt_task(n_layer=cfg.layers, d_model=cfg.dim, block_size=cfg.seq)


def _llama(cfg: CompileBenchConfig) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    heads = max(cfg.dim // 32, 1)
    config = transformers.LlamaConfig(hidden_size=cfg.dim, intermediate_size=4 * cfg.dim, num_hidden_layers=cfg.layers,
                                      num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), vocab_size=256,
                                      max_position_embeddings=cfg.seq, attn_implementation="sdpa")  # type: ignore[call-arg]
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _batches(cfg: CompileBenchConfig, model: str) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Step i's batch: the GPT example's corpus batches, or random token ids (labels = the ids) for Llama."""
    if model == "gpt":
        task = _gpt(cfg)
        return lambda i: task.batch(i, cfg.batch)

    def llama(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 256, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(i))
        return ids, ids
    return llama


def check(cfg: CompileBenchConfig) -> None:
    """ValueError unless the batch splits into the microbatches and the microbatches over the ranks."""
    if cfg.batch % cfg.microbatches or cfg.microbatches % cfg.ranks:
        raise ValueError(f"batch {cfg.batch} must split into microbatches {cfg.microbatches}, and those over ranks "
                         f"{cfg.ranks}")
    unknown = set(cfg.models) - set(MODELS) or set(cfg.restarts) - {"1f1b", "zb-h1"}
    if unknown:
        raise ValueError(f"unknown model or restart schedule {sorted(unknown)}; models {MODELS}, restarts 1f1b, zb-h1")


def _disable_linears(module: nn.Module) -> None:
    """Keep every Linear out of compiled regions (a graph break at each: the design with the weight matmuls eager)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.forward = torch._dynamo.disable(m.forward, recursive=False)  # type: ignore[method-assign]


def _user_compile(layers: list[nn.Module], backend: str, linears_out: bool) -> list[nn.Module]:
    for layer in layers:
        if linears_out:
            _disable_linears(layer)
    return [cast(nn.Module, torch.compile(layer, backend=backend)) for layer in layers]


def _pipeline(cfg: CompileBenchConfig, model: str, schedule: str, how: str) -> Pipeline:
    """`how`: "eager", "compiled" (PipelineConfig.compile), "whole at I" (the user compiled the layers: each
    region's backward runs whole at I) or "linears out" (the same, with every Linear outside the regions)."""
    microbatches = max(cfg.microbatches, 2 * cfg.ranks) if schedule == "dualpipev" else cfg.microbatches  # its least
    config = PipelineConfig(schedule=schedule, num_microbatches=microbatches,
                            compile={"backend": cfg.backend} if how == "compiled" else False,
                            observe=ObserveConfig(record_timeline=False))
    adamw = harness.adamw(1e-3)
    if model == "gpt":
        task = _gpt(cfg)
        layers = list(task.layers)
        if how in ("whole at I", "linears out"):
            layers = _user_compile(layers, cfg.backend, how == "linears out")
        return Pipeline.from_layers(layers, task.loss_fn, adamw, config, embedding=task.embedding, head=task.head)
    from duplexpipe.model.hf import causal_lm_loss, causal_lm_parts

    parts = 2 * dist.get_world_size() if schedule in ("dualpipev", "zbv") else dist.get_world_size()
    return Pipeline(causal_lm_parts(_llama(cfg), parts), causal_lm_loss, adamw, config)


def _plain(cfg: CompileBenchConfig, model: str, compiled: bool,
           batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> Callable[[Any, int], float]:
    """One process's training step of the whole model (its blocks compiled as the pipeline compiles them) over this
    rank's share of the batch, in microbatches of the pipeline's size with gradients accumulated."""
    if model == "gpt":
        task = _gpt(cfg)
        net: nn.Module = nn.Sequential(task.embedding, *task.layers, task.head)
        loss_fn = task.loss_fn
        blocks = [m for layer in task.layers for m, _ in compile_targets(layer)]
    else:
        from duplexpipe.model.hf import causal_lm_loss, causal_lm_parts

        net = causal_lm_parts(_llama(cfg), 1)[0]
        loss_fn = causal_lm_loss
        blocks = [m for m, _ in compile_targets(net)]
    if compiled:
        for block in blocks:
            block.compile(backend=cfg.backend)
    optimizer = harness.adamw(1e-3)(list(net.parameters()))
    size, count = cfg.batch // cfg.microbatches, cfg.microbatches // cfg.ranks
    first = dist.get_rank() * count * size

    def step(_: Any, i: int) -> float:
        x, y = batch(i)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for lo in range(first, first + count * size, size):
            loss = loss_fn(net(x[lo:lo + size]), y[lo:lo + size]) / count
            loss.backward()
            total += loss.item()
        optimizer.step()
        return total
    return step


def _names(cfg: CompileBenchConfig, model: str) -> list[str]:
    names = list(RUNS)
    if cfg.designs and model == "gpt":
        names += ["zb-h1 whole at I", "zb-h1 linears out"]
        names += [f"dualpipev {h}" for h in ("eager", "compiled", "whole at I", "linears out")]
    return names


def _runs(cfg: CompileBenchConfig, model: str) -> dict[str, dict[str, list[float]]]:
    """Per run, each round's step seconds: "wall" (the slowest rank's, between barriers) and "cpu" (this rank's CPU
    seconds: the work done, whatever else the machine runs). Every run steps once per round, in a rotating order."""
    names = _names(cfg, model)
    batch = _batches(cfg, model)
    steppers: list[tuple[Any, Callable[[Any, int], float]]] = []
    for name in names:
        kind, how = name.split(" ", 1)
        if kind == "plain":
            steppers.append((None, _plain(cfg, model, how == "compiled", batch)))
        else:
            steppers.append((_pipeline(cfg, model, kind, how), lambda pipe, i: pipe.step(*batch(i))))
    traces = harness.RoundRobin(steppers, lambda s, i: s[1](s[0], i)).run(cfg.rounds, warmup=cfg.warmup)
    return {name: {"wall": t.wall, "cpu": t.cpu} for name, t in zip(names, traces, strict=True)}


def _first_steps(rank: int, world: int, arg: tuple[CompileBenchConfig, str]) -> dict[str, float]:
    """A fresh process's first step (it compiles) and a later one, of the GPT pipeline under `schedule`."""
    cfg, schedule = arg
    pipe = _pipeline(cfg, "gpt", schedule, "compiled")
    batch = _batches(cfg, "gpt")
    step = harness.RoundRobin([pipe], lambda p, i: p.step(*batch(i))).run(RESTART_STEPS)[0].wall
    return {"first_s": step[0], "steady_s": statistics.median(step[1:])}


def worker(rank: int, world: int, cfg: CompileBenchConfig) -> dict[str, Any]:
    """Every model's runs on this rank, and the threads its torch ran on (the pipelines' and the loop's alike)."""
    return {"runs": {model: _runs(cfg, model) for model in cfg.models}, "threads": torch.get_num_threads()}


def _restarts(cfg: CompileBenchConfig) -> dict[str, dict[str, float]]:
    """First-step times in new processes: an empty inductor cache, then the same cache again (a restart)."""
    out: dict[str, dict[str, float]] = {}
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        for schedule in cfg.restarts:
            with tempfile.TemporaryDirectory(prefix="compile-bench-cache-") as cache:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
                for start in ("cold", "warm"):
                    began = time.perf_counter()
                    first = harness.spawn(_first_steps, (cfg, schedule), cfg.ranks, 1800.0)[0]
                    out[f"{schedule} {start}"] = {**first, "spawn_to_end_s": time.perf_counter() - began}
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
    return out


def run(cfg: CompileBenchConfig) -> Result:
    """The runs on `cfg.ranks` processes: per model and run, each round's slowest-rank step seconds."""
    check(cfg)
    results = harness.spawn(worker, cfg, cfg.ranks, 3600.0)
    rounds = {model: {kind: {name: harness.slowest([r["runs"][model][name][kind] for r in results])
                             for name in results[0]["runs"][model]} for kind in ("wall", "cpu")}
              for model in cfg.models}
    out: Result = {"config": asdict(cfg), "rounds_s": rounds, "threads": [r["threads"] for r in results]}
    if cfg.restarts:
        out["restarts"] = _restarts(cfg)
    return out


def _paired(series: dict[str, list[float]], num: str, den: str) -> float:
    """The median over rounds of num / den, each round's pair measured side by side."""
    return statistics.median(n / d for n, d in zip(series[num], series[den], strict=True))


def _kept(pipe_ratio: float, plain_ratio: float) -> float:
    """The share of the plain loop's saving (1 - compiled / eager) the pipeline's saving is."""
    saving = 1.0 - plain_ratio
    return (1.0 - pipe_ratio) / saving if saving else math.copysign(math.inf, 1.0 - pipe_ratio)


def estimates(series: dict[str, list[float]]) -> dict[str, float]:
    """From each round's step seconds of RUNS: compiled / eager of each (median of paired ratios), the share of the
    plain loop's saving each pipeline keeps, and ZB-H1 / 1F1B eager and compiled (paired the same way)."""
    out = {f"{k} ratio": _paired(series, f"{k} compiled", f"{k} eager") for k in ("plain", "1f1b", "zb-h1")}
    for k in ("1f1b", "zb-h1"):
        out[f"{k} kept"] = _kept(out[f"{k} ratio"], out["plain ratio"])
    for how in ("eager", "compiled"):
        out[f"zb/1f1b {how}"] = _paired(series, f"zb-h1 {how}", f"1f1b {how}")
    return out


def intervals(series: dict[str, list[float]], draws: int = DRAWS, level: float = LEVEL,
              seed: int = 0) -> dict[str, tuple[float, float]]:
    """Percentile-bootstrap intervals of every estimate: whole rounds resampled, so each pair stays together."""
    rng = random.Random(seed)
    runs = {name: series[name] for name in RUNS}
    n = len(runs[RUNS[0]])
    drawn: dict[str, list[float]] = {}
    for _ in range(draws):
        picks = [rng.randrange(n) for _ in range(n)]
        for key, value in estimates({name: [v[i] for i in picks] for name, v in runs.items()}).items():
            drawn.setdefault(key, []).append(value)
    tail = (1.0 - level) / 2
    return {key: (harness.quantile(values, tail), harness.quantile(values, 1.0 - tail))
            for key, values in drawn.items()}


def verdicts(series: dict[str, list[float]]) -> dict[str, Any]:
    """The estimates with their intervals, and each target's verdict: met by the estimate, and whether the interval
    decides it (lies wholly on one side of the target)."""
    est, ci = estimates(series), intervals(series)
    plain = 1.0 - est["plain ratio"]
    out: dict[str, Any] = {"est": est, "ci": ci, "plain_saving": plain, "judged": plain >= MIN_SAVING}
    for k in ("1f1b", "zb-h1"):
        lo, hi = ci[f"{k} kept"]
        out[f"{k} kept"] = (est[f"{k} kept"] >= KEPT, lo >= KEPT or hi < KEPT)
    for how in ("eager", "compiled"):
        lo, hi = ci[f"zb/1f1b {how}"]
        out[f"zb wins {how}"] = (est[f"zb/1f1b {how}"] < 1.0, hi < 1.0 or lo >= 1.0)
    return out


def _ci(value: float, interval: tuple[float, float], pct: bool = False) -> str:
    if pct:
        return f"{value:.0%} [{interval[0]:.0%}, {interval[1]:.0%}]"
    return f"{value:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"


def _verdict(ok_decided: tuple[bool, bool]) -> str:
    ok, decided = ok_decided
    return met(ok) + ("" if decided else " (the interval spans the target: not decided by this run)")


def _targets(v: dict[str, Any]) -> str:
    """The targets' sentence (wall clock)."""
    est = v["est"]
    if not v["judged"]:
        return (f"Compile saves {v['plain_saving']:.0%} of the plain loop's step here (under {MIN_SAVING:.0%}): there "
                "is no gain to keep, so the share kept is not judged.")
    kept = "; ".join(f"{label} {_verdict(v[f'{k} kept'])}" for k, label in (("1f1b", "1F1B"), ("zb-h1", "ZB-H1")))
    text = (f"Targets (wall clock): a pipeline keeps >= {KEPT:.0%} of the plain loop's saving "
            f"({v['plain_saving']:.0%}): {kept}. ")
    eager, _ = v["zb wins eager"]
    if not eager:
        return text + (f"ZB-H1 is not faster than 1F1B eager here ({est['zb/1f1b eager']:.2f}x): \"ZB-H1 compiled "
                       "still faster than 1F1B compiled\" is not put to the test.")
    return text + (f"ZB-H1 eager is {est['zb/1f1b eager']:.2f}x of 1F1B; compiled still faster "
                   f"({est['zb/1f1b compiled']:.2f}x): {_verdict(v['zb wins compiled'])}.")


def _model_blocks(model: str, rounds: dict[str, dict[str, list[float]]]) -> list[Block]:
    """One model's side-by-side table, ZB-H1 against 1F1B, its targets and (GPT) the split-backward designs."""
    wall, cpu = rounds["wall"], rounds["cpu"]
    v, est = verdicts(wall), estimates(wall)
    cpu_est = estimates(cpu)
    rows = [["run", "eager ms", "compiled ms", "compiled / eager [95%]", "saving kept [95%]", "CPU compiled / eager"]]
    for name, label in (("plain", "plain one-process loop"), ("1f1b", "1F1B pipeline"), ("zb-h1", "ZB-H1 pipeline")):
        kept = "" if name == "plain" or not v["judged"] else _ci(est[f"{name} kept"], v["ci"][f"{name} kept"], True)
        rows.append([label, ms(statistics.median(wall[f"{name} eager"])),
                     ms(statistics.median(wall[f"{name} compiled"])),
                     _ci(est[f"{name} ratio"], v["ci"][f"{name} ratio"]), kept, f"{cpu_est[f'{name} ratio']:.2f}"])
    versus = [["ZB-H1 / 1F1B [95%]", "eager", "compiled"],
              ["wall clock"] + [_ci(est[f"zb/1f1b {h}"], v["ci"][f"zb/1f1b {h}"]) for h in ("eager", "compiled")],
              ["CPU time"] + [f"{cpu_est[f'zb/1f1b {h}']:.2f}" for h in ("eager", "compiled")]]
    title = "GPT example (duplexpipe.launch.tasks.gpt)" if model == "gpt" else "transformers LlamaForCausalLM"
    share = statistics.median(c / w for c, w in zip(cpu["plain eager"], wall["plain eager"], strict=True))
    load = (f"The machine's load: each rank of the eager plain loop (no bubble, no messages) got {share:.0%} of a core "
            "(its CPU time over its wall-clock step, median over the rounds). A schedule's smaller bubble shortens "
            "the step only where a waiting rank would otherwise leave its core idle; under other jobs' load that "
            "core runs them instead.")
    out: list[Block] = [f"### {title}", rows, versus, _targets(v), load]
    if "dualpipev eager" in wall:
        designs = [["schedule", "eager", "two graphs (chosen)", "whole region at I", "linears out"]]
        for s in ("zb-h1", "dualpipev"):
            designs.append([s] + [f"{ms(statistics.median(wall[f'{s} {h}']))} "
                                  f"({ms(statistics.median(cpu[f'{s} {h}']))} CPU)"
                                  for h in ("eager", "compiled", "whole at I", "linears out")])
        out += ["Split-backward designs (median step ms, wall and CPU): two graphs = the region's backward cut into an "
                "I graph and a W graph; whole region at I = its backward runs whole at I, its weight gradients handed "
                "to W; linears out = every Linear left eager (split as eager layers), the rest compiled.", designs]
    return out


def report(r: Result) -> list[Block]:
    """Per model the side-by-side table and the targets; the designs; the first step cold and warm."""
    cfg = CompileBenchConfig(**r["config"])
    per_rank = cfg.microbatches // cfg.ranks
    blocks: list[Block] = [
        f"{cfg.ranks} gloo processes ({', '.join(map(str, r.get('threads', [])))} torch threads), {cfg.layers} blocks "
        f"of width {cfg.dim}, {cfg.batch} x {cfg.seq} tokens per step in {cfg.microbatches} microbatches, float32, "
        f"backend {cfg.backend}. The plain loop runs the whole model on each process over its share of the batch "
        f"({per_rank} microbatch{'' if per_rank == 1 else 'es'} of the pipeline's size, gradients accumulated): a "
        f"pipeline rank's work. {cfg.rounds} rounds after {cfg.warmup} untimed: in each every run takes one step, in a "
        "rotating order; a step's time is the slowest rank's. compiled / eager and ZB-H1 / 1F1B are medians of the "
        f"rounds' paired ratios, with {LEVEL:.0%} bootstrap intervals over the rounds; saving kept = (1 - the "
        "pipeline's compiled / eager) / (1 - the plain loop's)."]
    for model, rounds in r["rounds_s"].items():
        blocks += _model_blocks(model, rounds)
    if "restarts" in r:
        rows = [["schedule", "first step, empty cache (s)", "first step, same cache again (s)", "a later step (ms)"]]
        for s in cfg.restarts:
            cold, warm = r["restarts"][f"{s} cold"], r["restarts"][f"{s} warm"]
            rows.append([s, f"{cold['first_s']:.1f}", f"{warm['first_s']:.1f}", ms(warm["steady_s"])])
        blocks += ["### First step (GPT, fresh processes)", rows]
    return blocks


PART = Part("compile", "Compiled stages", CompileBenchConfig(), QUICK, run, report)

if __name__ == "__main__":
    raise SystemExit(main(only=PART.name))
