"""Part: each rank's measured memory (`pipe.last.memory`) against the planner's byte model, every schedule, GPT."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from benchmarks import harness
from benchmarks.framework import Block, Part, Result, mark, met
from benchmarks.runner import main
from duplexpipe import Pipeline, PipelineConfig, build_schedule, profile_parts, simulate
from duplexpipe.model.split import build_parts, plan_partition
from duplexpipe.planner.levers import checkpointed
from duplexpipe.planner.memory import GLOO_RECEIVES_AHEAD, MemoryConfig, StageBytes, rank_memory
from duplexpipe.train.pipeline_config import ObserveConfig, SafetyConfig

TARGET = 0.10
"""|measured - predicted| / predicted, per rank, of the peak of everything held and of the activations alone."""
CHECKPOINTED = " checkpointed"
"""The suffix of a case with full activation checkpointing."""
ADAMW_STATES = 2.0
"""Optimizer-state bytes per parameter byte the byte model is given: AdamW's two moments."""


@dataclass(frozen=True)
class MemoryBenchConfig:
    """The GPT example (`n_layer` blocks, width `d_model`) on `ranks` CPU processes under every schedule, `steps`
    steps each with AdamW; the last step's measured memory per rank against `planner.memory.rank_memory` over the
    simulated schedule, fed the bytes `profile_parts` counts on the same parts (one process, one microbatch)."""

    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min",
                                  "dualpipe", "dualpipev")
    ranks: int = 4
    microbatches: int = 8
    n_layer: int = 8
    d_model: int = 64
    batch_size: int = 32
    steps: int = 2
    checkpointing: tuple[bool, ...] = (False, True)  # each schedule without, then with full checkpointing
    levers: tuple[str, ...] = ("selective", "offload")  # then with selective checkpointing, with offload (True)


QUICK = MemoryBenchConfig(schedules=("1f1b", "zbv"), ranks=2, microbatches=4, n_layer=4, d_model=32, batch_size=8,
                          checkpointing=(False,), levers=())
LEVERS: dict[str, dict[str, Any]] = {"selective": {"activation_checkpointing": "selective"},
                                     "offload": {"activation_offload": True}}
"""A case's suffix beside " checkpointed": the PipelineConfig fields it sets."""
LEVER_NOTES = {
    "selective": ("selective checkpointing", "the model holds what `profile_parts` measures under the policy (the "
                  "outputs its cache keeps, the backward's needs once recomputed); as with full checkpointing it holds "
                  "a stage's whole recompute from its I to its W under a split backward (over) and not the "
                  "backward's own buffers beside it (under)."),
    "offload": ("offload (True)", "the model moves a forward's saved bytes to host at the end of the forward that "
                "chose it and back at the start of the compute before its backward (the runtime's plan, over the "
                "simulated timeline)."),
}
"""What each lever's report line says after its worst error."""


def cases(cfg: MemoryBenchConfig) -> list[str]:
    """Each schedule's name, then with " checkpointed" where asked, then with each of `cfg.levers`."""
    return [f"{s}{CHECKPOINTED}" if ckpt else s for ckpt in cfg.checkpointing for s in cfg.schedules] + \
        [f"{s} {lever}" for lever in cfg.levers for s in cfg.schedules]


def _config(case: str, cfg: MemoryBenchConfig) -> PipelineConfig:
    name, _, lever = case.partition(" ")
    levers: dict[str, Any] = {"activation_checkpointing": lever == "checkpointed", **LEVERS.get(lever, {})}
    return PipelineConfig(name, cfg.microbatches, grad_clip_norm=1.0,
                          safety=SafetyConfig(check_inputs_every_step=False),
                          observe=ObserveConfig(record_timeline=False, measure_memory=True), **levers)


def predicted(case: str, cfg: MemoryBenchConfig) -> list[dict[str, float]]:
    """The byte model's per-rank memory of `case`: the parts `Pipeline.from_layers` builds (uniform balance), each
    profiled on one microbatch (as the planner checkpoints them where asked), placed by the schedule and simulated
    with unit costs."""
    name, _, lever = case.partition(" ")
    task = harness.gpt(cfg.n_layer, cfg.d_model)
    schedule = build_schedule(name, cfg.ranks, cfg.microbatches)
    blocks = list(task.layers)
    partition = plan_partition(blocks, schedule.num_groups, "uniform", embedding=task.embedding, head=task.head)
    parts = build_parts(blocks, partition, embedding=task.embedding, head=task.head)
    x, y = task.batch(0, cfg.batch_size)
    rows = cfg.batch_size // cfg.microbatches
    profile = profile_parts(parts, x[:rows], target=y[:rows], loss_fn=task.loss_fn, repeats=1, warmup=0, fit_rows=0,
                            fused=False)
    policy = {"checkpointed": "full", "selective": "selective"}.get(lever)
    groups, recompute = checkpointed(profile.parts, policy) if policy else (tuple(profile.parts), ())
    sizes = StageBytes.of(schedule, groups, recompute)
    gloo = MemoryConfig(optimizer_factor=ADAMW_STATES, sends_held=True, receives_ahead=GLOO_RECEIVES_AHEAD,
                        offload=lever == "offload")
    memory = rank_memory(schedule, simulate(schedule), sizes, gloo)
    return [m.to_dict() for m in memory]


def worker(rank: int, world: int, cfg: MemoryBenchConfig) -> dict[str, Any]:
    """Per schedule: this rank's MemoryReport of the last of `cfg.steps` steps (rank 0 also the prediction)."""
    out: dict[str, Any] = {"measured": {}, "predicted": {}}
    task = harness.gpt(cfg.n_layer, cfg.d_model)
    step = harness.gpt_step(task, cfg.batch_size)
    for name in cases(cfg):
        pipe: Pipeline = harness.gpt_pipeline(harness.gpt(cfg.n_layer, cfg.d_model), _config(name, cfg),
                                              harness.adamw())
        for i in range(cfg.steps):
            step(pipe, i)
        assert pipe.last is not None and pipe.last.memory is not None
        report = pipe.last.memory.to_dict()
        report.pop("curve")
        out["measured"][name] = report
        if rank == 0:
            out["predicted"][name] = predicted(name, cfg)
        dist.barrier()
    return out


def run(cfg: MemoryBenchConfig) -> Result:
    """Every schedule on `cfg.ranks` processes; per schedule and rank the measured and predicted bytes."""
    results = harness.spawn(worker, cfg, cfg.ranks, 1800.0)
    rows = {}
    for name in cases(cfg):
        rows[name] = [{"measured": results[r]["measured"][name], "predicted": results[0]["predicted"][name][r]}
                      for r in range(cfg.ranks)]
    return {"config": asdict(cfg), "rows": rows}


def _error(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted if predicted else float("inf")


def errors(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The largest per-rank relative error of the total peak and of the activation peak."""
    return {"total": max(abs(_error(r["measured"]["total_peak"], r["predicted"]["peak"])) for r in rows),
            "activations": max(abs(_error(r["measured"]["activations_peak"], r["predicted"]["activations"]))
                               for r in rows)}


def report(result: Result) -> list[Block]:
    """Per schedule: each rank's measured / predicted peak, activations and messages, and the targets."""
    cfg, rows = result["config"], result["rows"]
    kib = 1024.0
    table = [["schedule", "rank", "peak measured KiB", "predicted KiB", "activations measured KiB", "predicted KiB",
              "messages measured KiB", "predicted KiB"]]
    worst: dict[str, dict[str, float]] = {}
    for name, ranks in rows.items():
        worst[name] = errors(ranks)
        for rank, r in enumerate(ranks):
            m, p = r["measured"], r["predicted"]
            table.append([name if rank == 0 else "", str(rank), f"{m['total_peak'] / kib:.1f}",
                          f"{p['peak'] / kib:.1f}", f"{m['activations_peak'] / kib:.1f}",
                          f"{p['activations'] / kib:.1f}",
                          f"{m['messages_peak'] / kib:.1f}", f"{p['messages'] / kib:.1f}"])
    verdicts = [["schedule", "worst rank: total peak error", "activations error", f"within {TARGET:.0%}"]] + [
        [name, f"{w['total']:.2%}", f"{w['activations']:.2%}", mark(max(w.values()) <= TARGET)]
        for name, w in worst.items()]
    plain = [w for name, w in worst.items() if " " not in name]
    checkpointed = [w for name, w in worst.items() if name.endswith(CHECKPOINTED)]
    every = all(max(w.values()) <= TARGET for w in plain)
    blocks: list[Block] = [
        f"The GPT example ({cfg['n_layer']} blocks, width {cfg['d_model']}, AdamW), {cfg['ranks']} CPU processes "
        f"(gloo), {cfg['microbatches']} microbatches of {cfg['batch_size'] // cfg['microbatches']} sequences. "
        f"Measured: `pipe.last.memory` of step {cfg['steps']} (the tensors each rank holds, walked after every "
        "action, the optimizer state added). Predicted: `planner.memory.rank_memory` over the schedule simulated "
        "with unit costs, fed `profile_parts`' bytes of the same parts (one process, one microbatch). Bytes do not "
        "depend on the machine's speed; messages in flight depend on the order the ranks meet (simulated against "
        "measured); the model holds gloo's sends until a reply proves them received and its receives from when they "
        "are posted, two ahead, as the runtime does.",
        table, verdicts,
        f"Every schedule within {TARGET:.0%} on every rank (total peak and activations): {met(every)}."]
    if checkpointed:
        high = max(max(w.values()) for w in checkpointed)
        blocks.append(f"With full checkpointing the worst error is {high:.0%}, in both directions: the model holds a "
                      "stage's whole recompute (its activation less its input) through its B, and from its I to its W "
                      "under a split backward, where W keeps only what its weight gradients need (over); it counts "
                      "what the recompute holds, not the backward's own buffers beside it (under). The measurement "
                      "samples each recompute inside its action and counts what the recomputed regions hold.")
    for lever in cfg.get("levers", ()):
        mine = [w for name, w in worst.items() if name.endswith(f" {lever}")]
        if mine:
            blocks.append(f"With {LEVER_NOTES[lever][0]} the worst error is {max(max(w.values()) for w in mine):.0%}"
                          f": {LEVER_NOTES[lever][1]}")
    if "1f1b" in rows:
        acts = [r["measured"]["activations_peak"] for r in rows["1f1b"]]
        blocks.append(f"1F1B: the first rank's measured activation peak is {acts[0] / acts[-1]:.2f}x the last's "
                      f"({cfg['ranks']} ranks).")
    return blocks


PART: Part[MemoryBenchConfig] = Part(
    name="memory_vs_predicted", title="Measured memory per rank against the byte model", config=MemoryBenchConfig(),
    quick=QUICK, run=run, report=report)

if __name__ == "__main__":
    raise SystemExit(main(only="memory_vs_predicted"))
