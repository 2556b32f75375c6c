"""Part 3: prefetched (asynchronous) receives against the same run with every receive waited at once."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from benchmarks import harness, models
from benchmarks.ours_side import build_ours, runtime_config
from duplexpipe.schedules.registry import build


@dataclass(frozen=True)
class OverlapConfig:
    """Large activations, little compute: how much the transfers hide behind compute."""

    width: int = 1 << 17
    """Features per sample: 2^17 float32 = 0.5 MiB per sample row."""
    samples_per_microbatch: int = 4
    """Rows per microbatch (2 MiB activations with the default width)."""
    num_microbatches: int = 8
    """Microbatches per step."""
    compute_ms: float = 2.0
    """Sleep per F, I and W: about two transfers' time here, so hiding the transfers can pay off."""
    schedules: tuple[str, ...] = ("1f1b", "zbv", "dualpipe")
    """Registry names to run."""
    warmup: int = 1
    """Untimed steps per mode."""
    reps: int = 8
    """Timed steps per mode; the modes alternate which goes first."""

    def spec(self) -> models.ModelSpec:
        """The sleep model with wide activations."""
        c = self.compute_ms
        return models.ModelSpec("sleep", width=self.width,
                                batch=self.num_microbatches * self.samples_per_microbatch,
                                sleep_ms=(c, c, c))

    @property
    def activation_mib(self) -> float:
        """MiB sent per microbatch and direction between two stages."""
        return self.width * self.samples_per_microbatch * 4 / 2**20


def _run_schedule(name: str, cfg: OverlapConfig, rank: int, world: int, batch: Any) -> dict[str, Any]:
    x, y = batch
    sched = build(name, world, cfg.num_microbatches)
    parts = models.build_parts(cfg.spec(), sched.num_groups)
    pipes = {
        "async": build_ours(name, parts, rank, world, cfg.num_microbatches, models.loss_fn,
                            config=runtime_config(record_timeline=False), schedule=sched),
        "waited": build_ours(name, parts, rank, world, cfg.num_microbatches, models.loss_fn,
                             config=runtime_config(record_timeline=False, prefetch=False), schedule=sched),
    }
    for _ in range(cfg.warmup):
        for pipe in pipes.values():
            pipe.zero_grad()
            pipe.step(x, y)
    samples: dict[str, list[float]] = {mode: [] for mode in pipes}
    for rep in range(cfg.reps):
        for mode in (("async", "waited") if rep % 2 == 0 else ("waited", "async")):
            pipe = pipes[mode]
            pipe.zero_grad()
            samples[mode].append(harness.timed(functools.partial(pipe.step, x, y))[0])
    return samples


def worker(rank: int, world: int, cfg: OverlapConfig) -> dict[str, Any]:
    """Time both modes for every schedule of `cfg`."""
    batch = models.make_batch(cfg.spec())
    return {name: _run_schedule(name, cfg, rank, world, batch) for name in cfg.schedules}


def _probe_worker(rank: int, world: int, numel: int) -> dict[str, float] | None:
    """Rank 1 waits for a message posted late (after the send) or early (before it); rank 0 sends."""
    import time

    import torch
    import torch.distributed as dist

    buf = torch.randn(numel)
    late: list[float] = []
    early: list[float] = []
    for _ in range(8):
        for mode in ("late", "early"):
            dist.barrier()
            if rank == 0:
                time.sleep(0.001)
                _wait(dist.isend(buf, 1))
                continue
            work = dist.irecv(buf, 0) if mode == "early" else None
            time.sleep(0.03)
            start = time.perf_counter()
            _wait(work if work is not None else dist.irecv(buf, 0))
            (early if mode == "early" else late).append(time.perf_counter() - start)
    if rank == 0:
        return None
    return {"late_post_wait_s": harness.summarize(late).median,
            "early_post_wait_s": harness.summarize(early).median}


def _wait(work: Any) -> None:
    work.wait()


def transfer_probe(mib: float, timeout_s: float = 120.0) -> dict[str, float]:
    """Two ranks, one message of `mib`: how long the receiver waits when it posts after the data was
    sent vs when it posted before (gloo moves data only into a posted receive)."""
    out = harness.spawn(_probe_worker, int(mib * 2**20 / 4), 2, timeout_s)[1]
    assert out is not None
    return {"mib": mib, **out}


def run(cfg: OverlapConfig, world: int = 4, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Spawn `world` gloo ranks and return one row per schedule."""
    raw = harness.spawn(worker, cfg, world, timeout_s)[0]
    rows = []
    for name, samples in raw.items():
        fast, slow = harness.summarize(samples["async"]), harness.summarize(samples["waited"])
        rows.append({"schedule": name, "activation_mib": cfg.activation_mib, "compute_ms": cfg.compute_ms,
                     "microbatches": cfg.num_microbatches, "async": fast.to_dict(),
                     "waited": slow.to_dict(), "speedup": slow.median / fast.median, "samples": samples})
    probe = transfer_probe(cfg.activation_mib)
    for row in rows:
        row["probe"] = probe
    return rows
