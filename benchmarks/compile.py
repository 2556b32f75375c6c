"""Part: compiled stages: how much of torch.compile's gain a pipeline keeps (1F1B, ZB-H1), the split-backward designs,
and the first step's compile time with a cold and a warm cache."""

from __future__ import annotations

import math
import os
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

MODELS = ("gpt", "llama")
"""The bundled GPT example, and a transformers Llama (random weights) the project was not written for."""
KEPT = 0.9
"""The least share of compile's one-process saving a pipeline keeps (1F1B and ZB-H1)."""
MIN_SAVING = 0.05
"""A plain-loop saving below this is too small to judge what share a pipeline keeps."""
RESTART_STEPS = 6
"""Steps of each fresh process timed after a restart: the first (it compiles or loads the cache), then the rest."""


@dataclass(frozen=True)
class CompileBenchConfig:
    """Each model: its blocks compiled with `backend` (PipelineConfig.compile) in a pipeline on `ranks` processes
    (1F1B and ZB-H1, eager and compiled, steps alternating) and in a plain one-process training loop of the same
    model on every rank at once (eager and compiled alternating). The designs of the split backward on ZB-H1 and
    DualPipeV (GPT): two graphs (the chosen), the whole region at I (what parts the user compiled get), and the
    weight matmuls kept out of the compiled regions. The first step's time in fresh processes, with an empty and
    with the same inductor cache."""

    models: tuple[str, ...] = MODELS
    layers: int = 4  # transformer blocks
    dim: int = 128  # model width
    seq: int = 64  # tokens per sequence
    batch: int = 16  # sequences per step
    microbatches: int = 4
    backend: str = "inductor"
    warmup: int = 3  # untimed steps per run (the first compiles)
    reps: int = 12  # timed steps per run
    designs: bool = True  # time the split-backward designs (GPT)
    restarts: bool = True  # time the first step cold and warm
    ranks: int = 2


QUICK = CompileBenchConfig(models=("gpt",), layers=4, dim=32, seq=16, batch=8, warmup=2, reps=2)


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
    config = PipelineConfig(schedule=schedule, num_microbatches=cfg.microbatches, record_timeline=False,
                            compile={"backend": cfg.backend} if how == "compiled" else False)
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
           batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> Callable[[int], float]:
    """One process's training step of the whole model (its blocks compiled as the pipeline compiles them)."""
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

    def step(i: int) -> float:
        x, y = batch(i)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def _runs(cfg: CompileBenchConfig, model: str) -> dict[str, dict[str, list[float]]]:
    """Step seconds of every pipeline run and of the plain loop, eager and compiled: "wall" (the slowest rank's,
    between barriers) and "cpu" (this rank's CPU seconds: the work done, whatever else the machine runs)."""
    names = [f"{s} {h}" for s in ("1f1b", "zb-h1") for h in ("eager", "compiled")]
    if cfg.designs and model == "gpt":
        names += ["zb-h1 whole at I", "zb-h1 linears out"]
        names += [f"dualpipev {h}" for h in ("eager", "compiled", "whole at I", "linears out")]
    pipes = [_pipeline(cfg, model, *name.split(" ", 1)) for name in names]
    batch = _batches(cfg, model)

    def step(pipe: Pipeline, i: int) -> float:
        return pipe.step(*batch(i))

    traces = harness.RoundRobin(pipes, step).run(cfg.reps, warmup=cfg.warmup)
    loops = [_plain(cfg, model, compiled, batch) for compiled in (False, True)]
    traces += harness.RoundRobin(loops, lambda loop, i: loop(i)).run(cfg.reps, warmup=cfg.warmup)
    names += ["plain eager", "plain compiled"]
    return {name: {"wall": t.wall, "cpu": t.cpu} for name, t in zip(names, traces, strict=True)}


def _first_steps(rank: int, world: int, arg: tuple[CompileBenchConfig, str]) -> dict[str, float]:
    """A fresh process's first step (it compiles) and a later one, of the GPT pipeline under `schedule`."""
    cfg, schedule = arg
    pipe = _pipeline(cfg, "gpt", schedule, "compiled")
    batch = _batches(cfg, "gpt")
    step = harness.RoundRobin([pipe], lambda p, i: p.step(*batch(i))).run(RESTART_STEPS)[0].wall
    return {"first_s": step[0], "steady_s": statistics.median(step[1:])}


def worker(rank: int, world: int, cfg: CompileBenchConfig) -> dict[str, Any]:
    """Every model's runs on this rank."""
    return {model: _runs(cfg, model) for model in cfg.models}


def _restarts(cfg: CompileBenchConfig) -> dict[str, dict[str, float]]:
    """First-step times in new processes: an empty inductor cache, then the same cache again (a restart)."""
    out: dict[str, dict[str, float]] = {}
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        for schedule in ("1f1b", "zb-h1"):
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
    """The runs on `cfg.ranks` processes; medians of the slowest rank's step seconds."""
    results = harness.spawn(worker, cfg, cfg.ranks, 3600.0)
    medians = {kind: {model: {name: statistics.median(harness.slowest([r[model][name][kind] for r in results]))
                              for name in results[0][model]} for model in cfg.models} for kind in ("wall", "cpu")}
    out: Result = {"config": asdict(cfg), "medians_s": medians["wall"], "cpu_medians_s": medians["cpu"]}
    if cfg.restarts:
        out["restarts"] = _restarts(cfg)
    return out


def _saving(eager: float, compiled: float) -> float:
    return 1.0 - compiled / eager


def verdicts(m: dict[str, float]) -> dict[str, Any]:
    """The shares of the plain loop's saving the pipelines keep, and whether ZB-H1 still beats 1F1B compiled."""
    plain = _saving(m["plain eager"], m["plain compiled"])
    kept = {s: _saving(m[f"{s} eager"], m[f"{s} compiled"]) / plain if plain >= MIN_SAVING else math.nan
            for s in ("1f1b", "zb-h1")}
    zb_wins_eager = m["zb-h1 eager"] < m["1f1b eager"]
    return {"plain_saving": plain, "kept": kept, "zb_wins_eager": zb_wins_eager,
            "zb_wins_compiled": m["zb-h1 compiled"] < m["1f1b compiled"]}


def _model_blocks(model: str, m: dict[str, float], cpu: dict[str, float]) -> list[Block]:
    """One model's side-by-side table (wall and CPU) and its targets (judged on the wall-clock step)."""
    v, vc = verdicts(m), verdicts(cpu)
    rows = [["run", "eager ms", "compiled ms", "compiled / eager", "saving kept", "CPU eager ms", "CPU compiled ms",
             "CPU compiled / eager", "CPU saving kept"]]
    for name, label in (("plain", "plain one-process loop"), ("1f1b", "1F1B pipeline"), ("zb-h1", "ZB-H1 pipeline")):
        row = [label]
        for medians, judged in ((m, v), (cpu, vc)):
            e, c = medians[f"{name} eager"], medians[f"{name} compiled"]
            kept = judged["kept"].get(name, math.nan)
            row += [ms(e), ms(c), f"{c / e:.2f}", "" if math.isnan(kept) else f"{kept:.0%}"]
        rows.append(row)
    title = "GPT example (duplexpipe.launch.tasks.gpt)" if model == "gpt" else "transformers LlamaForCausalLM"
    out: list[Block] = [f"### {title}", rows]
    if v["plain_saving"] < MIN_SAVING:
        out.append(f"Compile saves {v['plain_saving']:.0%} of the plain loop's wall-clock step here (under "
                   f"{MIN_SAVING:.0%}, within this machine's noise): there is no gain to keep. In CPU time the plain "
                   f"loop saves {vc['plain_saving']:.0%}.")
    else:
        out.append(f"Targets (wall clock): the pipeline keeps >= {KEPT:.0%} of the plain loop's saving "
                   f"({v['plain_saving']:.0%}): 1F1B {met(v['kept']['1f1b'] >= KEPT)}, ZB-H1 "
                   f"{met(v['kept']['zb-h1'] >= KEPT)}; ZB-H1 compiled faster than 1F1B compiled where it is eager "
                   f"({'it is' if v['zb_wins_eager'] else 'it is not'}): "
                   f"{met(v['zb_wins_compiled'] or not v['zb_wins_eager'])}. In CPU time the plain loop saves "
                   f"{vc['plain_saving']:.0%}.")
    if "dualpipev eager" in m:
        designs = [["schedule", "eager", "two graphs (chosen)", "whole region at I", "linears out"]]
        for s in ("zb-h1", "dualpipev"):
            designs.append([s] + [f"{ms(m[f'{s} {h}'])} ({ms(cpu[f'{s} {h}'])} CPU)"
                                  for h in ("eager", "compiled", "whole at I", "linears out")])
        out += ["Split-backward designs (step ms, wall and CPU): two graphs = the region's backward cut into an I "
                "graph and a W graph; whole region at I = its backward runs whole at I, its weight gradients handed "
                "to W; linears out = every Linear left eager (split as eager layers), the rest compiled.", designs]
    return out


def report(r: Result) -> list[Block]:
    """Per model the side-by-side table and the targets; the designs; the first step cold and warm."""
    cfg = CompileBenchConfig(**r["config"])
    blocks: list[Block] = [f"{cfg.ranks} gloo processes (one core each), {cfg.layers} blocks of width {cfg.dim}, "
                           f"{cfg.batch} x {cfg.seq} tokens per step in {cfg.microbatches} microbatches, float32, "
                           f"backend {cfg.backend}; medians of {cfg.reps} steps, runs alternating: the slowest "
                           "rank's wall-clock step and its CPU time (the work done: on a machine other jobs load, "
                           "the wall clock mostly measures the share of the cores the ranks got)."]
    for model, m in r["medians_s"].items():
        blocks += _model_blocks(model, m, r["cpu_medians_s"][model])
    if "restarts" in r:
        rows = [["schedule", "first step, empty cache (s)", "first step, same cache again (s)", "a later step (ms)"]]
        for s in ("1f1b", "zb-h1"):
            cold, warm = r["restarts"][f"{s} cold"], r["restarts"][f"{s} warm"]
            rows.append([s, f"{cold['first_s']:.1f}", f"{warm['first_s']:.1f}", ms(warm["steady_s"])])
        blocks += ["### First step (GPT, fresh processes)", rows]
    return blocks


PART = Part("compile", "Compiled stages", CompileBenchConfig(), QUICK, run, report)

if __name__ == "__main__":
    raise SystemExit(main(only=PART.name))
