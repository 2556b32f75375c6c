"""The adaptive reducer on 2 gloo ranks (one spawn): error feedback carried exactly across a switch, every rank
making the same moves from different local measurements, diverged controllers caught, and a DP=2 Pipeline
reporting its choices and exposure each step."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import run_workers
from torch import nn

from duplexpipe.comm import Bucket, blocking_wait, build_reducer
from duplexpipe.comm.adaptive_reducer import AdaptiveReducer
from duplexpipe.dp_options.compression import AdaptiveOptions
from duplexpipe.errors import PipelineError
from duplexpipe.train.checkpoint.plain_state import decode, encode

SPAWN_TIMEOUT_S = 120
SPEC = "adaptive(ladder=none/bf16, patience=1, up=0.0000001, down=0.00000005, max_hold=1)"
SHAPES = [(40, 8), (8,)]
NUMEL = 40 * 8 + 8


def _reduce(red: AdaptiveReducer, grad: torch.Tensor) -> torch.Tensor:
    bucket = Bucket(0, SHAPES, dtype=torch.float64)
    bucket.buffer().copy_(grad)
    out = red.start(bucket).finish().clone()
    red.end_step(True)
    return out


def _carry_case(rank: int) -> dict[str, Any]:
    """int8 for 3 steps, then (hidden) down to none: the residual int8 held is handed over exactly and sent."""
    opts = AdaptiveOptions(ladder="none/int8(block=16)", start="int8(block=16)", patience=1, max_hold=1)
    red = build_reducer(opts, buckets=[0])
    assert isinstance(red, AdaptiveReducer)
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(NUMEL, generator=gen, dtype=torch.float64) for _ in range(4)]
    outs = []
    for step, grad in enumerate(grads):
        outs.append(_reduce(red, grad))
        if step == 2:
            int8 = red.reducer(1)
            local = int8.residual.get(0).clone()  # type: ignore[attr-defined]
            owned = int8.owner_residual.get(0).clone()  # type: ignore[attr-defined]
            expect = local.clone()
            shard = owned.numel()
            begin = rank * shard
            expect[begin:begin + shard] += 2 * owned[: max(0, min(shard, NUMEL - begin))]
        red.post({0: 0.01 if step < 2 else 0.0}, 1.0, None, torch.device("cpu"))
        if step < 3:
            moves = red.settle(blocking_wait)  # between steps
        if step == 2:
            assert [(d.before, d.after) for d in moves] == [("int8(block=16)", "none")]
            carried = red.carry[0].clone()
            skeleton, tensors = encode(red.state_dict())  # what a checkpoint keeps
            resumed = build_reducer(opts, buckets=[0])
            resumed.load_state_dict(decode(skeleton, tensors))
    assert 0 not in red.carry  # consumed by the step under "none"
    assert isinstance(resumed, AdaptiveReducer)
    assert torch.equal(_reduce(resumed, grads[3]), outs[3])  # resumed from the checkpointed state: the same step
    total = torch.stack(grads).sum(0)
    dist.all_reduce(total)
    sent = torch.stack(outs).sum(0)
    return {"carry_exact": torch.equal(carried, expect), "carry_norm": float(carried.norm()),
            "mass_error": float((sent - total / 2).abs().max()), "residual_after": red.reducer(1).take_residual(0)}


def _agree_case(rank: int) -> dict[str, Any]:
    """Rank 0 sees bucket 0 exposed 50% of the step, rank 1 30%: both move it up on the group's smallest (30%: the
    rest was rank 0 waiting for rank 1); bucket 3, exposed on rank 0 alone (skew), stays."""
    opts = AdaptiveOptions(ladder="none/bf16", patience=2)
    red = build_reducer(opts, buckets=[0, 3])
    assert isinstance(red, AdaptiveReducer)
    red.controller.shared = False  # each bucket on its own measurements (shared, bucket 3 would climb with 0)
    moves = []
    for _ in range(2):
        _reduce_two(red)
        report = red.post({0: 0.5 if rank == 0 else 0.3, 3: 0.5 if rank == 0 else 0.0}, 1.0, None,
                          torch.device("cpu"))
        moves += [str(d) for d in red.settle(blocking_wait)]
    choices = red.controller.choices()
    red.controller._state["bucket 3"].rung = rank  # a diverged controller: caught at the next agreement
    try:
        red.post({0: 0.0, 3: 0.0}, 1.0, None, torch.device("cpu"))
        red.settle(blocking_wait)
        caught = ""
    except PipelineError as exc:
        caught = str(exc)
    return {"moves": moves, "exposed": dict(report.exposed_s), "agreed": red.controller.log[0].reason,
            "choices": choices, "caught": caught}


def _reduce_two(red: AdaptiveReducer) -> None:
    for index in (0, 3):
        bucket = Bucket(index, SHAPES)
        bucket.buffer().normal_()
        red.start(bucket).finish()
    red.end_step(True)


def _pipeline_case(rank: int) -> dict[str, Any]:
    """A DP=2 Pipeline with grad_compression="adaptive" on a scripted clock (each read 1 ms later): every bucket's
    wait is exposed, so every bucket moves up at the same step on both ranks; choices and exposure every step."""
    from duplexpipe import Pipeline, PipelineConfig
    from duplexpipe.parallel.mesh import make_mesh
    from duplexpipe.train.pipeline_config import DataParallelConfig

    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(2)]
    config = PipelineConfig("1f1b", 2, data_parallel=DataParallelConfig(grad_compression="adaptive(patience=1)",
                                                                       grad_bucket_bytes=1200))
    pipe = Pipeline.from_layers(layers, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.01), config,
                                mesh=make_mesh(1, 2))
    ticks = itertools.count()
    pipe.dp.clock = lambda: next(ticks) * 1e-3
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    reports = []
    for _ in range(3):
        pipe.step(x, y)
        last = pipe.last
        assert last is not None and last.compression is not None and last.exposure is not None
        lanes = {s.lane for s in last.timeline.spans} if last.timeline is not None else set()
        reports.append({"choices": dict(last.compression.choices), "exposed": dict(last.exposure.buckets),
                        "moves": [str(d) for d in last.compression.decisions], "exposed_lane": "exposed" in lanes})
    return {"reports": reports, "buckets": len(pipe.dp.buckets)}


def _links_case(rank: int) -> dict[str, Any]:
    """PP=2 with p2p_compression="adaptive": both ends of each link switch at the same step, training goes on as
    with exact sends (bf16 rounding apart)."""
    from duplexpipe import Pipeline, PipelineConfig
    from duplexpipe.comm.link import LinkModel
    from duplexpipe.parallel.mesh import make_mesh
    from duplexpipe.runtime.link_emulator import emulate_sends
    from duplexpipe.train.pipeline_config import PrecisionConfig

    def build(p2p: str | None) -> Any:
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)]
        config = PipelineConfig("1f1b", 2, precision=PrecisionConfig(p2p_compression=p2p))
        return Pipeline.from_layers(layers, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.05), config,
                                    mesh=make_mesh(2, 1))

    adaptive = build(SPEC)
    exact = build(None)
    gen = torch.Generator().manual_seed(1)
    choices, gaps = [], []
    for _ in range(8):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
        got, want = adaptive.step(x, y), exact.step(x, y)
        gaps.append(abs(got - want) / want)
        report = adaptive.last.compression
        choices.append(dict(report.choices) if report is not None else {})
    assert adaptive.links is not None
    resumed = _resume(adaptive, lambda: build(SPEC))
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
    after = [adaptive, resumed.pop("pipe")]
    for pipe in after:
        pipe.step(x, y)  # the rungs saved (the resumed one dropped the agreement in flight: it decides nothing yet)
    resumed["step_choices"] = [dict(p.last.compression.choices) for p in after]
    emulated = build(None)  # the same, every message held for an emulated link of 50 ms latency
    emulate_sends(emulated.runtime, LinkModel(latency_s=0.05))
    reference = build(None)
    gen = torch.Generator().manual_seed(2)
    equal, waited = True, []
    for _ in range(2):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
        equal &= emulated.step(x, y) == reference.step(x, y)
        assert emulated.last is not None and emulated.last.exposure is not None
        waited.append(sum(emulated.last.exposure.links.values()))
    return {"choices": choices, "moves": [str(d) for d in adaptive.links.controller.log], "gap": max(gaps),
            "emulated_equal": equal, "emulated_waits": waited, "resumed": resumed}


def _resume(saved: Any, build: Any) -> dict[str, Any]:
    """Checkpoint `saved` (adaptive stage links) and load it into a new pipeline of `build()`: the links' state."""
    folder = [tempfile.mkdtemp(prefix="adaptive-links-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(folder)
    saved.save(folder[0])
    pipe = build()
    fresh = pipe.links.controller.state_dict()
    pipe.load(folder[0])
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])
    return {"pipe": pipe, "state_equal": pipe.links.controller.state_dict() == saved.links.controller.state_dict(),
            "fresh_equal": fresh == saved.links.controller.state_dict(),
            "rungs_equal": pipe.links.codec.links.rungs == saved.links.codec.links.rungs}


def _worker(rank: int, world: int) -> dict[str, Any]:
    return {"carry": _carry_case(rank), "agree": _agree_case(rank), "pipeline": _pipeline_case(rank),
            "links": _links_case(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(_worker, 2, timeout_s=SPAWN_TIMEOUT_S)


def test_residual_is_handed_over_exactly_and_no_gradient_mass_is_lost(results: list[dict[str, Any]]) -> None:
    for r in results:
        c = r["carry"]
        assert c["carry_exact"] and c["carry_norm"] > 1e-3  # something was held back, and handed over exactly
        assert c["mass_error"] < 1e-12  # sum of what was sent == sum of the mean gradients (float64)
        assert c["residual_after"] is None  # the old rung keeps nothing of it


def test_every_rank_makes_the_same_moves_from_the_groups_maximum(results: list[dict[str, Any]]) -> None:
    one, two = (r["agree"] for r in results)
    assert one["moves"] == two["moves"] and len(one["moves"]) == 1 and "bucket 0 none -> bf16" in one["moves"][0]
    assert one["exposed"] == {"bucket 0": 0.5, "bucket 3": 0.5} and two["exposed"] == {"bucket 0": 0.3, "bucket 3": 0.0}
    assert one["agreed"] == two["agreed"] == "exposed 30.0% of the step for 2 steps"  # the group's smallest
    assert one["choices"] == two["choices"] == {"bucket 0": "bf16", "bucket 3": "none"}
    for r in (one, two):
        assert "the data-parallel group used different rungs for ['bucket 3']" in r["caught"]


def test_a_pipeline_reports_choices_and_exposure_each_step(results: list[dict[str, Any]]) -> None:
    for r in results:
        p = r["pipeline"]
        n = p["buckets"]
        keys = [f"bucket {i}" for i in range(n)]
        assert n >= 2
        for report in p["reports"]:
            assert sorted(report["choices"]) == keys and report["exposed_lane"]
            # each read of the scripted clock 1 ms later: bucket i completed 2 (i + 1) reads after the compute ended
            assert report["exposed"] == {i: pytest.approx(2e-3 * (i + 1)) for i in range(n)}
        first, second, third = p["reports"]
        assert first["moves"] == [] and set(first["choices"].values()) == {"none"}
        assert len(second["moves"]) == n and all(f"{k} none -> bf16 (exposed" in m
                                                 for k, m in zip(keys, second["moves"], strict=True))
        assert set(third["choices"].values()) == {"bf16"}
    assert results[0]["pipeline"]["reports"] == results[1]["pipeline"]["reports"]


def test_stage_links_switch_on_both_ends_at_the_same_step(results: list[dict[str, Any]]) -> None:
    one, two = (r["links"] for r in results)
    assert one["choices"] == two["choices"] and one["moves"] == two["moves"]
    assert set(one["choices"][0]) == {"link 0->1", "link 1->0"}
    used = {rung for step in one["choices"] for rung in step.values()}
    assert used == {"none", "bf16"}, "the links moved between rungs during the run"
    assert one["gap"] < 1e-2  # the loss as with exact sends, up to bf16's rounding


def test_a_checkpoint_keeps_the_stage_links_rungs(results: list[dict[str, Any]]) -> None:
    for r in results:
        resumed = r["links"]["resumed"]
        assert resumed["state_equal"] and resumed["rungs_equal"] and not resumed["fresh_equal"]
        continued, loaded = resumed["step_choices"]
        assert continued == loaded


def test_emulated_stage_sends_arrive_late_and_unchanged(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["links"]["emulated_equal"]
        assert all(w >= 0.05 for w in r["links"]["emulated_waits"])  # a lower bound: sleeping never ends early
