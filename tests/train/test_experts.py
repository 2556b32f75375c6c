"""MoE with expert parallelism in a Pipeline (PP=2 x DP=2 with ep=2, 4 gloo ranks, float64, 4 MoE blocks,
3 AdamW steps) against one process holding every expert: DualPipe, DualPipeV, 1F1B and ZB-H1 with the F&B
overlap on and off (bit-equal), balance losses and the expert bias on, a router steered so that one rank's
experts get no token, every rank issuing its exchanges in one order, ZeRO-1 and gradient compression with
experts, and the errors a bad expert-parallel layout gets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _moe_cases import MoESpec, Reference, adamw, batch, build, compare, loss_fn, sgd, snapshot
from models import shared_folder

from duplexpipe import Pipeline, PipelineConfig, make_mesh
from duplexpipe.runtime.executor import EP_LANE
from duplexpipe.train.pipeline_config import DataParallelConfig

WORLD = 4
SPAWN_TIMEOUT_S = 400
STEPS, MICRO = 3, 4
BALANCED = MoESpec(aux=0.01, speed=0.01)
STEERED = MoESpec(bias=(0.0, 0.0, -1e3, -1e3))
"""Experts 2 and 3 (ep rank 1's) are never chosen: that rank's experts get no token."""
CASES: dict[str, tuple[str, MoESpec, dict[str, Any]]] = {
    **{f"{s} overlap={o}": (s, BALANCED, {"fb_overlap": o})
       for s in ("dualpipe", "dualpipev", "1f1b", "zb-h1") for o in (True, False)},
    "dualpipev steered": ("dualpipev", STEERED, {}),
    "dualpipe zero1": ("dualpipe", BALANCED, {"data_parallel": DataParallelConfig(zero_stage=1)}),
    "1f1b sgd": ("1f1b", BALANCED, {"optimizer": sgd}),
    "1f1b sgd bf16 compression": ("1f1b", BALANCED, {"optimizer": sgd, "steps": 1,
                                                     "data_parallel": DataParallelConfig(grad_compression="bf16")}),
}


def _run(rank: int, schedule: str, spec: MoESpec, extra: dict[str, Any]) -> dict[str, Any]:
    embedding, blocks, head = build(spec)
    options = dict(extra)
    optimizer = options.pop("optimizer", adamw)
    steps = options.pop("steps", STEPS)
    config = PipelineConfig(schedule=schedule, num_microbatches=MICRO, **options)
    pipe = Pipeline.from_layers(blocks, loss_fn, optimizer, config, embedding=embedding, head=head,
                                mesh=make_mesh(2, 2, ep=2))
    losses, lanes = [], []
    for step in range(steps):
        losses.append(pipe.step(*batch(step, pipe.groups.dp_rank)))
        timeline = pipe.last.timeline if pipe.last is not None else None
        lanes.append([s.name for s in timeline.spans if s.lane == EP_LANE] if timeline is not None else [])
    ref = Reference(spec, optimizer=optimizer)
    ref_losses = [ref.step(step, 2, MICRO) for step in range(steps)]
    groups = {s: pipe.schedule.stages[s].group for s in pipe.stage_modules}
    ref_parts = ref.parts(pipe.partition)
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
            "param_err": compare(pipe.stage_modules, groups, ref_parts),
            "expert_err": compare(pipe.stage_modules, groups, ref_parts, only="experts."),
            "state": snapshot(pipe.stage_modules), "lanes": lanes, "pp": pipe.groups.pp_rank,
            "overlap": pipe.runtime.config.fb_overlap, "experts": sorted({k.split("experts.")[1].split(".")[0]
                                                                          for k in pipe.stage_modules[min(
                                                                              pipe.stage_modules)].state_dict()
                                                                          if "experts." in k})}


def _resume_with_fewer_expert_ranks(rank: int) -> dict[str, Any]:
    """2 steps with ep=2, saved; loaded with ep=1 (every rank holds every expert); a third step. Against 3
    uninterrupted steps of the one-process model."""
    runs = {}
    with shared_folder("moe-ckpt-") as where:
        for ep, steps in ((2, range(2)), (1, range(2, 3))):
            embedding, blocks, head = build(BALANCED)
            pipe = Pipeline.from_layers(blocks, loss_fn, adamw, PipelineConfig(num_microbatches=MICRO),
                                        embedding=embedding, head=head, mesh=make_mesh(2, 2, ep=ep))
            if ep == 1:
                pipe.load(where)
            for step in steps:
                pipe.step(*batch(step, pipe.groups.dp_rank))
            if ep == 2:
                pipe.save(where)
            runs[ep] = pipe
    pipe = runs[1]
    ref = Reference(BALANCED)
    for step in range(3):
        ref.step(step, 2, MICRO)
    groups = {s: pipe.schedule.stages[s].group for s in pipe.stage_modules}
    return {"param_err": compare(pipe.stage_modules, groups, ref.parts(pipe.partition)),
            "experts": sorted({k.split("experts.")[1].split(".")[0] for m in pipe.stage_modules.values()
                               for k in m.state_dict() if "experts." in k})}


def _errors(rank: int) -> dict[str, str]:
    out = {}
    embedding, blocks, head = build(MoESpec(experts=3, top_k=1))
    try:
        Pipeline.from_layers(blocks, loss_fn, adamw, PipelineConfig(), embedding=embedding, head=head,
                             mesh=make_mesh(2, 2, ep=2))
    except ValueError as exc:
        out["experts"] = str(exc)
    try:
        make_mesh(2, 2, ep=3)
    except ValueError as exc:
        out["mesh"] = str(exc)
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {name: _run(rank, *case) for name, case in CASES.items()}
    for schedule in ("dualpipe", "dualpipev"):  # tensors do not outlive the worker: compare them here
        on, off = out[f"{schedule} overlap=True"]["state"], out[f"{schedule} overlap=False"]["state"]
        out[f"{schedule} bit-equal"] = on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)
    for name in CASES:
        out[name].pop("state")
    out["errors"] = _errors(rank)
    out["resume"] = _resume_with_fewer_expert_ranks(rank)
    return out


@pytest.mark.parametrize("name", [n for n in CASES if "compression" not in n])
def test_equal_to_one_process_holding_every_expert(results: list[dict[str, Any]], name: str) -> None:
    for rank, result in enumerate(results):
        assert result[name]["loss_err"] < 1e-10 and result[name]["param_err"] < 1e-10, (rank, name, result[name])


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_overlap_on_and_off_are_bit_equal(results: list[dict[str, Any]], schedule: str) -> None:
    for result in results:
        assert result[f"{schedule} overlap=True"]["overlap"] and not result[f"{schedule} overlap=False"]["overlap"]
        assert result[f"{schedule} bit-equal"]


def test_schedules_without_pairs_have_nothing_to_overlap(results: list[dict[str, Any]]) -> None:
    assert not any(result[f"{s} overlap=True"]["overlap"] for result in results for s in ("1f1b", "zb-h1"))


def test_experts_are_spread_and_named_by_global_index(results: list[dict[str, Any]]) -> None:
    # ranks 0 and 1 are the two expert-parallel ranks of pipeline rank 0 (dp index = ep index)
    assert results[0]["1f1b overlap=True"]["experts"] == ["0", "1"]
    assert results[1]["1f1b overlap=True"]["experts"] == ["2", "3"]


def test_every_rank_of_an_expert_parallel_group_issues_the_same_exchanges(results: list[dict[str, Any]]) -> None:
    for name in CASES:
        for a, b in ((0, 1), (2, 3)):  # the two ranks of each expert-parallel group
            assert results[a][name]["lanes"] == results[b][name]["lanes"], name
            assert all(results[a][name]["lanes"]), name


def test_gradient_compression_keeps_working_with_experts(results: list[dict[str, Any]]) -> None:
    """One SGD step: the dense gradients go through a bf16 all-reduce, the experts' are reduced exactly, so the
    experts step exactly as in one process and the rest within bf16's rounding of the update (3.9e-3 of
    it; a gradient scaled twice or reduced over the wrong group would be off by far more)."""
    for result in results:
        case = result["1f1b sgd bf16 compression"]
        assert case["expert_err"] < 1e-12 and case["param_err"] < 1e-2, case


def test_bad_expert_parallel_layouts_name_the_values(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert "num_experts=3 is not divisible by the expert-parallel size ep=2" in result["errors"]["experts"]
        assert "ep=3 must be a positive int dividing dp=2" in result["errors"]["mesh"]


def test_a_checkpoint_saved_with_ep_2_resumes_with_ep_1(results: list[dict[str, Any]]) -> None:
    """Experts are stored under their global index: every rank of the ep=1 run finds all of them."""
    for result in results:
        assert result["resume"]["experts"] == ["0", "1", "2", "3"]
        assert result["resume"]["param_err"] < 1e-10, result["resume"]
