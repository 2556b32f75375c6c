"""Part: adaptive gradient compression against each static setting, the GPT example at PP=2 x DP=2 on an emulated
data-parallel link at three bandwidths and one that changes mid-run."""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from benchmarks import harness, runner
from benchmarks.framework import Block, Part, Result, figure, mark
from duplexpipe import PipelineConfig
from duplexpipe.comm.link import EmulatedLink, LinkModel
from duplexpipe.train.pipeline_config import DataParallelConfig, ObserveConfig, SafetyConfig

STATIC = ("none", "bf16", "int8")  # the static settings (the adaptive ladder's rungs)
ADAPTIVE = "adaptive"
TARGET_STEP = 0.10  # adaptive's mean step at most this much over the best static's, at each fixed bandwidth
TARGET_LOSS = 0.01  # |adaptive's loss - uncompressed's| / uncompressed's, at most
TARGET_COST = 0.01  # the controller's seconds over the step's, at most


@dataclass(frozen=True)
class AdaptiveBenchConfig:
    """Per link condition, one spawn of PP x DP gloo processes trains every variant round-robin on the same batches."""

    steps: int = 200  # training steps of every variant and condition
    timed_from: int = 5  # steps before this one are not timed (warm-up)
    tail: int = 20  # the loss figure is the mean of this many last steps
    pp: int = 2  # pipeline ranks
    dp: int = 2  # data-parallel replicas
    microbatches: int = 4  # microbatches per step and replica
    task_options: dict[str, Any] = field(default_factory=lambda: {"n_layer": 4, "d_model": 64})  # gpt_task options
    batch_size: int = 32  # sequences per step over all replicas
    lr: float = 3e-3  # AdamW learning rate
    bucket_bytes: int = 96 * 2**10  # gradient bucket capacity (several buckets per rank, each chosen on its own)
    ladder: str = "none/bf16/int8"  # the adaptive ladder
    patience: int = 3  # the adaptive patience
    latency_s: float = 2e-4  # emulated link latency per collective
    bandwidths: tuple[float, ...] = (1e8, 8e6, 1.5e6)  # fixed emulated bandwidths, bytes/s
    changing: tuple[float, float] = (1e8, 1.5e6)  # the changing link: the first half at one, the second at the other
    cost_layout: tuple[int, int] = (1, 2)  # PP x DP of the run that measures the controller with a core per rank
    cost_steps: int = 60  # that run's steps (adaptive alone, at the middle fixed bandwidth)

    def __post_init__(self) -> None:
        if self.steps < max(self.tail, self.timed_from) + 2:
            raise ValueError(f"steps must be >= max(tail, timed_from) + 2, got {self.steps}")


QUICK = AdaptiveBenchConfig(steps=12, tail=3, timed_from=2, bandwidths=(8e6,), changing=(1e8, 1.5e6), cost_steps=6)


def _conditions(cfg: AdaptiveBenchConfig) -> list[tuple[str, tuple[float, ...]]]:
    fixed = [(f"{b / 1e6:g} MB/s", (b,)) for b in cfg.bandwidths]
    return fixed + [(f"{cfg.changing[0] / 1e6:g} -> {cfg.changing[1] / 1e6:g} MB/s", cfg.changing)]


def _worker(rank: int, world: int,
            job: tuple[AdaptiveBenchConfig, tuple[float, ...], tuple[str, ...]]) -> dict[str, Any]:
    cfg, bandwidths, variants = job
    task = harness.gpt(**cfg.task_options)
    pipes, links = [], []
    for name in variants:
        spec = f"adaptive(ladder={cfg.ladder}, patience={cfg.patience})" if name == ADAPTIVE else name
        pipe = harness.gpt_pipeline(task, PipelineConfig(
            "1f1b", cfg.microbatches, grad_clip_norm=1.0, observe=ObserveConfig(record_timeline=True),
            data_parallel=DataParallelConfig(grad_compression=spec, dp_strategy="compressed",
                                             grad_bucket_bytes=cfg.bucket_bytes),
            safety=SafetyConfig(check_inputs_every_step=False)), harness.adamw(cfg.lr), cfg.pp, cfg.dp)
        link = EmulatedLink(LinkModel(cfg.latency_s, bandwidths[0]))
        pipe.dp.emulate_link(link)
        pipes.append(pipe)
        links.append(link)
    by_pipe = {id(p): link for p, link in zip(pipes, links, strict=True)}
    train = harness.gpt_step(task, cfg.batch_size)

    def step(pipe: Any, i: int) -> float:
        bandwidth = bandwidths[0] if i < cfg.steps // 2 else bandwidths[-1]  # a change at mid-run (if two)
        by_pipe[id(pipe)].model = LinkModel(cfg.latency_s, bandwidth)
        return train(pipe, i)

    def extra(pipe: Any) -> dict[str, Any]:
        last = pipe.last
        report = last.compression
        return {"controller_s": report.controller_s if report is not None else 0.0,
                "controller_cpu_s": report.controller_cpu_s if report is not None else 0.0,
                "choices": dict(report.choices) if report is not None else {},
                "exposed_s": sum(last.exposure.buckets.values()) if last.exposure is not None else 0.0,
                "wire": last.wire_bytes}

    traces = harness.RoundRobin(pipes, step, extra).run(cfg.steps)
    return {name: {"losses": t.out, "step_s": t.wall, "extra": t.extra}
            for name, t in zip(variants, traces, strict=True)}


def _summary(name: str, ranks: list[dict[str, Any]], cfg: AdaptiveBenchConfig) -> dict[str, Any]:
    """Per variant: mean step (timed steps), loss (tail), exposed seconds, bytes; adaptive: its cost and choices."""
    out: dict[str, Any] = {"condition": name, "variants": {}}
    for variant in (*STATIC, ADAPTIVE):
        lead = ranks[0][variant]
        steps = lead["step_s"][cfg.timed_from:]
        per_rank = [r[variant]["extra"] for r in ranks]
        cost = [max(x[i]["controller_s"] for x in per_rank) / s
                for i, s in enumerate(lead["step_s"]) if i >= cfg.timed_from]
        cpu = [max(x[i]["controller_cpu_s"] for x in per_rank) / s
               for i, s in enumerate(lead["step_s"]) if i >= cfg.timed_from]
        rungs = [sorted(x["choices"].items()) for x in lead["extra"]]
        out["variants"][variant] = {
            "mean_step_s": statistics.fmean(steps), "loss": statistics.fmean(lead["losses"][-cfg.tail:]),
            "losses": lead["losses"], "step_s": lead["step_s"],
            "exposed_s": statistics.fmean(statistics.fmean(x[i]["exposed_s"] for x in per_rank)
                                          for i in range(cfg.timed_from, cfg.steps)),
            "wire_bytes": statistics.fmean(x["wire"] for x in lead["extra"][cfg.timed_from:]),
            "controller_share": statistics.median(cost), "controller_cpu_share": statistics.median(cpu),
            "choices": rungs}
    return out


def _cost(cfg: AdaptiveBenchConfig) -> dict[str, Any]:
    """The controller's share of a step with a core per rank (no rank waits for a core while it decides): adaptive
    alone on `cost_layout` at the middle fixed bandwidth; the same statistic as the rows'."""
    pp, dp = cfg.cost_layout
    small = replace(cfg, pp=pp, dp=dp, steps=cfg.cost_steps)
    bandwidth = cfg.bandwidths[len(cfg.bandwidths) // 2]
    ranks = harness.spawn(_worker, (small, (bandwidth,), (ADAPTIVE,)), pp * dp, 3600)
    step_s = ranks[0][ADAPTIVE]["step_s"]
    per_rank = [r[ADAPTIVE]["extra"] for r in ranks]
    timed = range(cfg.timed_from, len(step_s))
    return {"pp": pp, "dp": dp, "steps": cfg.cost_steps, "bandwidth": bandwidth, "cores": os.cpu_count(),
            "controller_share": statistics.median(max(x[i]["controller_s"] for x in per_rank) / step_s[i]
                                                  for i in timed),
            "controller_cpu_share": statistics.median(max(x[i]["controller_cpu_s"] for x in per_rank) / step_s[i]
                                                      for i in timed),
            "controller_s": statistics.median(max(x[i]["controller_s"] for x in per_rank) for i in timed),
            "controller_cpu_s": statistics.median(max(x[i]["controller_cpu_s"] for x in per_rank) for i in timed),
            "mean_step_s": statistics.fmean(step_s[i] for i in timed)}


def run(cfg: AdaptiveBenchConfig) -> Result:
    """Every condition: one spawn, all variants; then the controller's cost with a core per rank."""
    rows = [_summary(name, harness.spawn(_worker, (cfg, bandwidths, (*STATIC, ADAPTIVE)), cfg.pp * cfg.dp, 3600),
                     cfg) for name, bandwidths in _conditions(cfg)]
    return {"rows": rows, "cost": _cost(cfg), "config": asdict(cfg)}


def _checks(row: dict[str, Any], changing: bool) -> dict[str, Any]:
    v = row["variants"]
    best = min(v[s]["mean_step_s"] for s in STATIC)
    ada = v[ADAPTIVE]
    speed = ada["mean_step_s"] < best if changing else ada["mean_step_s"] <= best * (1 + TARGET_STEP)
    loss = abs(ada["loss"] - v["none"]["loss"]) / v["none"]["loss"]
    return {"best_static_s": best, "ratio": ada["mean_step_s"] / best, "speed_ok": speed, "loss_rel": loss,
            "loss_ok": loss <= TARGET_LOSS, "cost_ok": ada["controller_share"] <= TARGET_COST,
            "cpu_cost_ok": ada.get("controller_cpu_share", 0.0) <= TARGET_COST}


def report(result: Result) -> list[Block]:
    """How it ran, one row per condition, what adaptive chose."""
    cfg = result["config"]
    table = [["link", *(f"{s} ms" for s in STATIC), "adaptive ms", "vs best static", "target", "met",
              "loss (adaptive)", "vs none", "met (1%)", "controller / step: wall", "met (1%)", "CPU", "met (1%)",
              "rungs at the end"]]
    for k, row in enumerate(result["rows"]):
        changing = k == len(result["rows"]) - 1
        c, v = _checks(row, changing), row["variants"]
        final = ", ".join(label for _, label in v[ADAPTIVE]["choices"][-1]) if v[ADAPTIVE]["choices"] else "-"
        table.append([row["condition"], *(f"{v[s]['mean_step_s'] * 1e3:.1f}" for s in STATIC),
                      f"{v[ADAPTIVE]['mean_step_s'] * 1e3:.1f}", f"{c['ratio']:.3f}x",
                      "< 1 (faster than all)" if changing else f"<= {1 + TARGET_STEP:g}", mark(c["speed_ok"]),
                      f"{v[ADAPTIVE]['loss']:.4f}", f"{c['loss_rel']:+.2%}", mark(c["loss_ok"]),
                      f"{v[ADAPTIVE]['controller_share']:.3%}", mark(c["cost_ok"]),
                      f"{v[ADAPTIVE].get('controller_cpu_share', 0.0):.3%}", mark(c["cpu_cost_ok"]), final])
    return [f"GPT example ({cfg['task_options']}), PP={cfg['pp']} x DP={cfg['dp']} gloo processes on this CPU, 1F1B, "
            f"{cfg['microbatches']} microbatches, AdamW, buckets of {cfg['bucket_bytes'] // 1024} KiB, {cfg['steps']} "
            f"steps per variant trained round-robin on the same batches. Every data-parallel collective is held for an "
            f"emulated link (`duplexpipe.comm.link.EmulatedLink`: {cfg['latency_s'] * 1e3:g} ms latency + bytes / "
            f"bandwidth, transfers queued one after another); the last row's link changes at step "
            f"{cfg['steps'] // 2}. Step: the mean over steps {cfg['timed_from']}.. of the slowest rank's seconds; "
            f"loss: the mean of the last {cfg['tail']} steps; controller: the median share of a step (slowest rank) "
            f"that posting and completing the agreement all-reduce and deciding took, in wall seconds and in the "
            f"thread's CPU seconds (the wall figure includes waiting for a core on a loaded machine; the all-reduce "
            f"is not held for the emulated link). Adaptive: ladder {cfg['ladder']}, patience {cfg['patience']}, "
            f"starting at none. The variants of a row ran side by side (round-robin), so a row compares them under "
            f"the same load; rows ran one after another and do not compare with each other.", table,
            *_cost_lines(result.get("cost"), result["rows"], cfg)]


def _cost_lines(cost: dict[str, Any] | None, rows: list[dict[str, Any]], cfg: dict[str, Any]) -> list[Block]:
    """The controller's cost with a core per rank, beside the rows' (which ran more processes than cores): its seconds
    per step over its own step, and over the shortest adaptive step of the rows (the strictest share)."""
    if cost is None:
        return []
    cores = cost["cores"] or 0
    spare = cores >= cost["pp"] * cost["dp"]
    shortest = min(r["variants"][ADAPTIVE]["mean_step_s"] for r in rows)
    strict = cost["controller_s"] / shortest
    return [f"The controller's own cost with {'a core per rank' if spare else 'more ranks than cores'}: adaptive "
            f"alone at PP={cost['pp']} x DP={cost['dp']} ({cost['pp'] * cost['dp']} processes, {cores} cores), "
            f"{cost['steps']} steps at {cost['bandwidth'] / 1e6:g} MB/s: {cost['controller_s'] * 1e6:.0f} us wall "
            f"({cost['controller_cpu_s'] * 1e6:.0f} us CPU) per step, {cost['controller_share']:.3%} of its "
            f"{cost['mean_step_s'] * 1e3:.1f} ms step and {strict:.3%} of the shortest adaptive step above "
            f"({shortest * 1e3:.1f} ms; target at most {TARGET_COST:.0%}: {mark(strict <= TARGET_COST)}). The rows "
            f"above ran {cfg['pp'] * cfg['dp']} processes on {cores} cores: their wall figure also holds the time a "
            f"rank waited for a core while deciding."]


def figures(result: Result, folder: str) -> list[tuple[str, str]]:
    """Step time per step on the changing link, every variant; and adaptive's rung count per step."""
    row = result["rows"][-1]
    fig = figure(9.0, 5.4)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for c, variant in enumerate((*STATIC, ADAPTIVE)):
        step_s = row["variants"][variant]["step_s"]
        top.plot(range(len(step_s)), [s * 1e3 for s in step_s], color=f"C{c}", linewidth=1.0, label=variant)
    top.set(ylabel="step ms (slowest rank)", title=f"Changing link ({row['condition']}), PP=2 x DP=2")
    top.legend(fontsize=7.5)
    choices = row["variants"][ADAPTIVE]["choices"]
    labels = result["config"]["ladder"].split("/")
    for r, label in enumerate(labels):
        bottom.plot(range(len(choices)), [sum(1 for _, x in step if x == label) for step in choices],
                    color=f"C{r}", linewidth=1.0, label=label)
    bottom.set(xlabel="step", ylabel="buckets on rung (rank 0)")
    bottom.legend(fontsize=7.5)
    fig.savefig(os.path.join(folder, "adaptive_comm.png"))
    return [("adaptive_comm.png", "Step time on a changing link and the rungs adaptive compression chose")]


PART = Part("adaptive_comm", "Adaptive gradient compression on an emulated link", AdaptiveBenchConfig(), QUICK, run,
            report, figures, block="adaptive-comm")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
