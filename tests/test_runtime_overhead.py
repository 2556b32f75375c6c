"""runtime_overhead: the calibration runs the real runtime on 2 gloo ranks and solves from what it measured."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import run_workers

from duplexpipe.pipeline import PipelineConfig
from duplexpipe.pipeline.runtime_overhead import TinyPart, measure_overhead
from duplexpipe.schedules import registry
from duplexpipe.schedules.overhead import rank_counts


def _calibrate(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = PipelineConfig(record_timeline=False, check_inputs_every_step=False)
    cal = measure_overhead(torch.randn(2, 8), steps=2, warmup=1, config=config)
    o = cal.overhead
    return {"overhead": (o.action_s, o.message_s, o.step_s), "method": o.method, "wall": cal.wall_s,
            "samples": [(s.actions, s.messages, s.seconds) for s in cal.samples], "tiny": cal.tiny_s}


@pytest.mark.timeout(120)
def test_calibration_on_two_ranks_measures_every_rank_on_every_run() -> None:
    results = run_workers(_calibrate, 2, timeout_s=100)
    first = results[0]
    assert all(r["overhead"] == first["overhead"] for r in results)  # every rank solved the same samples
    assert min(first["overhead"]) >= 0 and first["tiny"] >= 0
    runs = [("1f1b", 2), ("1f1b", 4), ("zb-h1", 4)]
    counts = [(a, n) for a, n, _ in first["samples"]]
    assert counts == [rank_counts(registry.build(name, 2, m))[r] for r in range(2) for name, m in runs]
    assert sorted(first["wall"]) == sorted(runs) and all(v > 0 for v in first["wall"].values())
    assert "1f1b M=2, 1f1b M=4, zb-h1 M=4 on 2 ranks" in first["method"]


def test_tiny_part_and_bad_arguments() -> None:
    part = TinyPart()
    x = torch.randn(3, 4)
    assert torch.equal(part(x), x) and sum(p.numel() for p in part.parameters()) == 1
    with pytest.raises(ValueError, match="initialized process group"):
        measure_overhead(x)
