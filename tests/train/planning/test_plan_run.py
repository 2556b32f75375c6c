"""schedule="auto" runs what it printed: on 2 pipeline ranks x 2 replicas, the planner's schedule, M, ZeRO stage and
gradient compression are what the Pipeline's runtime and data-parallel strategy run; fields set in the config are
fixed; and the in-pipeline calibration on the user path solves its terms and is cached.

One launch of 4 gloo processes runs every case. Profiling time comes from a scripted timer and the calibration's
CPU time from a scripted CPU timer (no wall-clock dependence).
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _clocks import ScriptedClock
from _train_helpers import adam, batch, make_parts, mse

from duplexpipe.dp_options.compression import options_label
from duplexpipe.parallel.mesh import make_mesh
from duplexpipe.planner.calibrate import calibration_runs, calibration_schedule
from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.profile import PartProfile, Profile
from duplexpipe.planner.runtime_work import rank_counts, rank_work
from duplexpipe.train.pipeline_config import AUTO, DataParallelConfig
from duplexpipe.train.planning import plan_pipeline
from duplexpipe.train.trainer import Pipeline, PipelineConfig

WORLD = 4
SPAWN_TIMEOUT_S = 240
HEAVY_LAST = [(1e-3, 1e-3, 1e-3)] * 3 + [(6e-3, 6e-3, 6e-3)]
OPTIONS = {"schedules": ("1f1b", "zb-h1"), "repeats": 1, "warmup": 0, "fit_rows": 0, "fused": False,
           "evict_bytes": 0, "calibrate": False, "dp_link": Link(bandwidth=1e5), "optimizer_factor": 1000.0}
"""A slow data-parallel link (compression pays) and heavy optimizer states (ZeRO pays under a limit)."""
TERMS = (1.3, 2e-4, 1e-4, 3e-3)
"""The scripted calibration's compute scale, work per action, per SEND/RECV and per step."""
LOGGED = re.compile(r"schedule='auto' chose (\S+), M=(\d+), ZeRO (\d), gradient compression (\S+) ")


class ScriptedCpu:
    """The calibration reads the CPU clock before and after each step, the runs alternating with the first one
    rotating (`calibration.timed_steps`): each step of run c costs this rank `seconds[c]`."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds, self.reads, self.now = seconds, 0, 0.0

    def __call__(self) -> float:
        pair, end = divmod(self.reads, 2)
        self.reads += 1
        if end:
            step, k = divmod(pair, len(self.seconds))
            self.now += self.seconds[(step + k) % len(self.seconds)]
        return self.now


def _expected_seconds(pp_rank: int) -> list[float]:
    """What each calibration run costs this pipeline rank under TERMS, from the scripted profile (16 rows, the
    profile on the first of 2 microbatches: the largest of the divisors 2..16 of the batch)."""
    profile = Profile(tuple(PartProfile(f, i, w, 0, 0, 0, 0) for f, i, w in HEAVY_LAST), 8)
    alpha, action, message, step = TERMS
    out = []
    for name, m in calibration_runs(2, [2, 4, 8, 16], profile.num_parts):
        schedule = calibration_schedule(name, 2, m)
        groups = profile.at_microbatch(16 / m).grouped(schedule.num_groups, profile.group_sizes(schedule.num_groups))
        actions, messages = rank_counts(schedule)[pp_rank]
        out.append(alpha * rank_work(schedule, groups)[pp_rank] + action * actions + message * messages + step)
    return out


def _pipe(mesh: Any, options: dict[str, Any], **fields: Any) -> tuple[Pipeline, list[str]]:
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("duplexpipe.plan")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        x, y = batch(0)
        config = PipelineConfig(schedule=AUTO, num_microbatches=4, schedule_options={
            **OPTIONS, "timer": ScriptedClock(HEAVY_LAST), **options}, **fields)
        parts = make_parts(4)
        plan = plan_pipeline(parts, mse, adam, config, mesh=mesh, sample_input=x, sample_targets=y)
        return Pipeline(parts, mse, adam, plan, mesh=mesh), records
    finally:
        logger.removeHandler(handler)


def _ran(pipe: Pipeline, records: list[str]) -> dict[str, Any]:
    """What was printed and what runs, and two training steps."""
    losses = [pipe.step(*batch(step)) for step in range(2)]
    assert pipe.auto is not None
    return {"log": records, "plan": pipe.plan.summary(), "table": pipe.auto.result.table(),
            "ran": {"schedule": pipe.schedule.name, "chunks": pipe.schedule.num_groups // pipe.schedule.num_ranks,
                    "microbatches": pipe.schedule.num_microbatches, "zero": pipe.dp.ctx.zero_stage,
                    "compression": options_label(pipe.dp.ctx.compression), "strategy": type(pipe.dp).__name__,
                    "config": (pipe.config.num_microbatches, pipe.config.data_parallel.zero_stage,
                               options_label(pipe.config.data_parallel.grad_compression))},  # type: ignore[arg-type]
            "rows": [(r.zero, r.peak_bytes) for r in pipe.auto.result.rows], "losses": losses}


def _calibrated(mesh: Any) -> dict[str, Any]:
    """The user path's calibration with scripted CPU time, then the same Pipeline again: from the cache."""
    shared = [tempfile.mkdtemp(prefix="duplexpipe-cal-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    pp_rank = dist.get_rank() // 2  # make_mesh: rank = pp_index * dp + dp_index
    cpu = ScriptedCpu(_expected_seconds(pp_rank))
    options = {"calibrate": True, "cpu_timer": cpu, "calibration_cache": shared[0], "calibration_budget_s": 0.0}
    first, _ = _pipe(mesh, options)
    clock = ScriptedClock([(1.0, 1.0, 1.0)])  # were it read, the profile would change
    cpu_again = ScriptedCpu([1.0, 1.0, 1.0])
    again, _ = _pipe(mesh, {**options, "timer": clock, "cpu_timer": cpu_again})
    assert first.auto is not None and again.auto is not None and first.auto.profile.overhead is not None
    o = first.auto.profile.overhead
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(shared[0])
    return {"terms": (o.compute_scale, o.action_s, o.message_s, o.step_s), "cpu_reads": cpu.reads,
            "source": (first.auto.source, again.auto.source), "reads_again": (clock.reads, cpu_again.reads),
            "same": (again.plan == first.plan, again.auto.profile == first.auto.profile)}


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = make_mesh(2, 2)
    free = _ran(*_pipe(mesh, {}))
    zero1 = max(peak for zero, peak in free["rows"] if zero == 1)
    return {"free": free, "limit": zero1, "capped": _ran(*_pipe(mesh, {}, memory_limit=int(zero1))),
            "fixed": _ran(*_pipe(mesh, {}, data_parallel=DataParallelConfig(zero_stage=0, grad_compression="bf16"))),
            "calibrated": _calibrated(mesh)}


def _strategy(zero: int, compression: str) -> str:
    return {1: "Zero1Strategy", 2: "Zero2Strategy"}.get(zero, "ReplicatedStrategy" if compression == "none"
                                                        else "CompressedStrategy")


@pytest.mark.parametrize("case", ["free", "capped", "fixed"])
def test_what_ran_is_what_was_printed(results: list[dict[str, Any]], case: str) -> None:
    lead = results[0][case]
    assert len(lead["log"]) == 1 and all(r[case]["log"] == [] for r in results[1:]), "rank 0 logs once"
    schedule, m, zero, compression = LOGGED.match(lead["log"][0]).groups()  # type: ignore[union-attr]
    for result in results:
        ran = result[case]["ran"]
        assert result[case]["plan"] == lead["plan"] and lead["plan"] in lead["log"][0]
        assert ran["schedule"] == schedule.split("(")[0] and ran["microbatches"] == int(m)
        assert (ran["zero"], ran["compression"]) == (int(zero), compression)
        assert ran["strategy"] == _strategy(int(zero), compression)
        assert ran["config"] == (int(m), int(zero), compression)
        assert all(math.isfinite(loss) for loss in result[case]["losses"])


def test_the_planner_chooses_zero_and_compression_and_respects_fixed_fields(results: list[dict[str, Any]]) -> None:
    free, capped, fixed = (results[0][case]["ran"] for case in ("free", "capped", "fixed"))
    assert (free["zero"], free["compression"]) == (0, "int8"), "a slow link: compression, no limit: no ZeRO"
    assert (capped["zero"], capped["compression"], capped["strategy"]) == (1, "int8", "Zero1Strategy")
    assert (fixed["zero"], fixed["compression"], fixed["strategy"]) == (0, "bf16", "CompressedStrategy")
    assert "dgc" not in results[0]["free"]["table"], "DGC under Adam is refused by the trainer: never planned"
    assert all(" 0 powersgd" not in line for line in results[0]["capped"]["table"].splitlines()
               if not line.endswith("KiB") and "cap" not in line)


def test_the_calibration_runs_on_the_user_path_and_is_cached(results: list[dict[str, Any]]) -> None:
    for result in results:
        cal = result["calibrated"]
        assert cal["terms"] == pytest.approx(TERMS, rel=1e-6, abs=1e-9), "the scripted terms, solved back"
        runs = len(calibration_runs(2, [2, 4, 8, 16], 4))
        assert runs == 4 and cal["cpu_reads"] == 2 * runs * 4, "runs x (1 warm-up + 3 rounds: a budget of 0 s) x 2"
        assert cal["source"][0].startswith("measured, cached in ") and cal["source"][1].startswith("cache ")
        assert cal["reads_again"] == (0, 0) and cal["same"] == (True, True)
