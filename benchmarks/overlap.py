"""Part: receives posted ahead against receives moved right before their consumers, waited for at once."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness, models, runner
from benchmarks.framework import Block, Part, Result, bars, mark, ms
from benchmarks.models import build_ours
from duplexpipe import Action, Op, Schedule, build_schedule, lower

TARGET = 1.3  # waited / async step time, at least
CONSUMER = MappingProxyType({Op.RECV_F: (Op.F,), Op.RECV_B: (Op.B, Op.I)})  # a receive's consumers' ops


def receives_at_consumers(schedule: Schedule) -> Schedule:
    """`schedule` lowered, each receive moved down to right before its consumer but not past a later receive from the
    same peer (the sender's order): with recv_lookahead=0, no transfer into a rank overlaps its compute."""
    lowered = lower(schedule)
    rows = []
    for row in lowered.actions:
        compute = [a for a in row if not a.op.is_comm]
        consumer_at = {(p.stage, p.op, p.microbatch): k for k, a in enumerate(compute) for p in a.compute_parts()}
        placed: dict[int, list[Action]] = {}  # compute index -> receives posted right before it
        due: dict[int, int] = {}  # peer -> where its next receive (in list order) is posted
        recvs = [a for a in row if a.op in CONSUMER]
        for recv in reversed(recvs):
            at = min(consumer_at[(recv.stage, op, recv.microbatch)] for op in CONSUMER[recv.op]
                     if (recv.stage, op, recv.microbatch) in consumer_at)
            peer = _peer(lowered, recv)
            at = due[peer] = min(at, due.get(peer, at))
            placed.setdefault(at, []).insert(0, recv)
        rows.append(tuple(_merge(row, placed)))
    return Schedule(lowered.name, lowered.num_ranks, lowered.num_microbatches, lowered.stages, tuple(rows))


def _peer(schedule: Schedule, recv: Action) -> int:
    """The rank a receive comes from: the previous stage's (RECV_F) or the next stage's (RECV_B)."""
    other = schedule.prev_stage(recv.stage) if recv.op is Op.RECV_F else schedule.next_stage(recv.stage)
    assert other is not None, recv
    return schedule.stages[other].rank


def _merge(row: tuple[Action, ...], placed: dict[int, list[Action]]) -> list[Action]:
    """`row` without its receives, the k-th compute preceded by `placed[k]` (sends stay where they were)."""
    out: list[Action] = []
    k = 0
    for action in row:
        if action.op in CONSUMER:
            continue
        if not action.op.is_comm:
            out += placed.get(k, [])
            k += 1
        out.append(action)
    return out


@dataclass(frozen=True)
class OverlapConfig:
    """Large activations, little compute: how much the transfers hide behind compute."""

    width: int = 1 << 17  # features per sample: 2^17 float32 = 0.5 MiB per sample row
    samples_per_microbatch: int = 4  # rows per microbatch (2 MiB activations with the default width)
    num_microbatches: int = 8  # microbatches per step
    compute_ms: float = 2.0  # sleep per F, I and W: about two transfers' time here, so hiding the transfers can pay off
    schedules: tuple[str, ...] = ("1f1b", "zbv", "dualpipe")  # registry names to run
    warmup: int = 1  # untimed steps per mode
    reps: int = 8  # timed steps per mode; the modes alternate which goes first
    world: int = 4  # pipeline ranks (gloo processes)

    def spec(self) -> models.ModelSpec:
        """The sleep model with wide activations."""
        c = self.compute_ms
        return models.ModelSpec("sleep", width=self.width, batch=self.num_microbatches * self.samples_per_microbatch,
                                sleep_ms=(c, c, c))

    @property
    def activation_mib(self) -> float:
        """MiB sent per microbatch and direction between two stages."""
        return self.width * self.samples_per_microbatch * 4 / 2**20


QUICK = OverlapConfig(width=1024, num_microbatches=4, compute_ms=1.0, schedules=("1f1b",), warmup=1, reps=2, world=2)


def worker(rank: int, world: int, cfg: OverlapConfig) -> dict[str, Any]:
    """Both modes of every schedule, a step of each in turn; then the transfer probe."""
    x, y = models.make_batch(cfg.spec())
    out = {}
    for name in cfg.schedules:
        sched = build_schedule(name, world, cfg.num_microbatches)
        parts = models.build_parts(cfg.spec(), sched.num_groups)
        pipes = [build_ours(name, parts, rank, world, cfg.num_microbatches, sched, record_timeline=False),
                 build_ours(name, parts, rank, world, cfg.num_microbatches, receives_at_consumers(sched),
                            record_timeline=False, recv_lookahead=0)]
        traces = harness.RoundRobin(pipes, lambda p, _: p.step(x, y)).run(cfg.reps, cfg.warmup)
        out[name] = {"async": traces[0].wall, "waited": traces[1].wall}
    return {"rows": out, "probe": _probe(rank, int(cfg.activation_mib * 2**20 / 4))}


def _probe(rank: int, numel: int) -> dict[str, float] | None:
    """Rank 1 waits for a message posted late (after the send) or early (before it); rank 0 sends."""
    buf = torch.randn(numel)
    waits: dict[str, list[float]] = {"late": [], "early": []}
    for _ in range(8):
        for mode, samples in waits.items():
            dist.barrier()
            if rank != 1:
                time.sleep(0.001)
                if rank == 0:
                    dist.send(buf, 1)
                continue
            work = dist.irecv(buf, 0) if mode == "early" else None
            time.sleep(0.03)
            start = time.perf_counter()
            if work is None:
                dist.recv(buf, 0)
            else:
                work.wait()
            samples.append(time.perf_counter() - start)
    return None if rank != 1 else {f"{m}_post_wait_s": harness.summarize(w).median for m, w in waits.items()}


def run(cfg: OverlapConfig) -> Result:
    """One row per schedule, and the transfer probe (a receive posted after vs before the send)."""
    per_rank = harness.spawn(worker, cfg, cfg.world, 600)
    rows = []
    for name, samples in per_rank[0]["rows"].items():
        fast, slow = harness.summarize(samples["async"]), harness.summarize(samples["waited"])
        rows.append({"schedule": name, "activation_mib": cfg.activation_mib, "compute_ms": cfg.compute_ms,
                     "microbatches": cfg.num_microbatches, "async": fast.to_dict(), "waited": slow.to_dict(),
                     "speedup": slow.median / fast.median, "samples": samples})
    return {"rows": rows, "probe": {"mib": cfg.activation_mib, **per_rank[1]["probe"]}}


def report(result: Result) -> list[Block]:
    """One row per schedule, and the probe in a sentence."""
    p = result["probe"]
    return [[["schedule", "activation MiB", "compute ms (F, I, W each)", "async ms", "waited ms", "waited/async",
              "target", "met"]] + [[r["schedule"], f"{r['activation_mib']:.1f}", f"{r['compute_ms']:g}",
                                    ms(r["async"]["median_s"]), ms(r["waited"]["median_s"]), f"{r['speedup']:.2f}",
                                    f">= {TARGET:g}", mark(r["speedup"] >= TARGET)] for r in result["rows"]],
            f"Isolated transfer of {p['mib']:.1f} MiB between two gloo ranks: the receiver waits "
            f"{p['late_post_wait_s'] * 1e3:.2f} ms when it posts the receive after the data was sent, "
            f"{p['early_post_wait_s'] * 1e3:.2f} ms when it posted it in advance."]


def figures(result: Result, folder: str) -> list[tuple[str, str]]:
    """Waited / async per schedule."""
    rows = result["rows"]
    bars(os.path.join(folder, "bench_overlap.png"), [r["schedule"] for r in rows],
         {"waited / async": [r["speedup"] for r in rows]}, TARGET, f"target {TARGET:g}", "step time, waited / async",
         "Receives posted ahead vs moved before their consumers (higher is better)")
    return [("bench_overlap.png", "Step time with receives waited at their consumers over receives posted ahead")]


PART = Part("overlap", "Communication overlap", OverlapConfig(), QUICK, run, report, figures)

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
