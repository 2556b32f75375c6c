"""Tests for duplexpipe.parallel.zero3 combined with the rest of the framework, float64 against one process (gloo,
two spawns): tensor parallelism at PP2 x DP2 x TP2 (FSDP2 over "dp", DTensor on "tp"; 8 ranks) for 1F1B and
DualPipeV; and at PP2 x DP2 (4 ranks) expert parallelism (ep=2: the experts whole on their expert-parallel ranks,
the dense parameters sharded) for 1F1B and DualPipeV with the F&B overlap off and on, compile (aot_eager),
activation checkpointing and gradient accumulation."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import _moe_cases as moe
import _tp_cases as tpc
import pytest
import torch
from _train_helpers import batch, make_parts
from _zero_cases import CLIP, adamw, flat_params, local_batch, max_rel
from torch import Tensor, nn

from duplexpipe import Pipeline, PipelineConfig, make_mesh
from duplexpipe.model.stages import inner_module
from duplexpipe.train.pipeline_config import DataParallelConfig, with_defaults
from duplexpipe.train.planning.auto import resolve_schedule

SPAWN_TIMEOUT_S = 400
STEPS, MICRO = 3, 4
TP_CASES = {"1f1b": ("1f1b", False, None), "dualpipev": ("dualpipev", False, None),
            "1f1b sp": ("1f1b", True, None), "dualpipev window 1": ("dualpipev", False, 1)}
"""name -> (schedule, sequence parallelism, reshard_window) at PP2 x DP2 x TP2."""
MOE_SPEC = moe.MoESpec(aux=0.01, speed=0.01)
EP_CASES = {"1f1b": ("1f1b", False, 3, 2), "dualpipev": ("dualpipev", False, 3, 2),
            "dualpipev overlap": ("dualpipev", True, 3, 2), "1f1b zero2": ("1f1b", False, 2, 2),
            "1f1b edp 2": ("1f1b", False, 3, 1)}
"""name -> (schedule, F&B overlap, zero_stage, pp) on the MoE model with ep=2 over the 4 ranks (pp=1: dp=4, so two
replicas hold each expert and reduce it over their expert-data-parallel group)."""
DENSE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "compile": ("1f1b", {"compile": {"backend": "aot_eager"}}),
    "checkpointing": ("zbv", {"activation_checkpointing": True}),
    "accumulation": ("1f1b", {"accumulation_steps": 2}),
}
"""name -> (schedule, PipelineConfig fields) on the dense parts at PP2 x DP2."""


def _guarded(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except Exception:  # noqa: BLE001 - reported per case by the tests
        return {"error": traceback.format_exc()}


def _tp_case(schedule: str, sp: bool, window: int | None) -> dict[str, Any]:
    cfg = PipelineConfig(schedule, MICRO, grad_clip_norm=CLIP, sequence_parallel=sp,
                         data_parallel=DataParallelConfig(zero_stage=3, reshard_window=window))
    pipe = tpc.pipeline((2, 2, 2), cfg)
    return {"losses": tpc.train(pipe, range(STEPS)), "zero3": type(pipe.dp).__name__,
            "tp_params": sum(1 for p in pipe.params if "tp" in (p.device_mesh.mesh_dim_names or ())
                             and "dp" in (p.device_mesh.mesh_dim_names or ()))}


def _tp_worker() -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    try:
        return {name: _guarded(lambda c=case: _tp_case(*c)) for name, case in TP_CASES.items()}
    finally:
        torch.set_default_dtype(torch.float32)


def _full(t: Tensor) -> Tensor:
    gather = getattr(t, "full_tensor", None)
    return (gather() if gather is not None else t).detach()


def _ep_case(schedule: str, overlap: bool, stage: int, pp: int) -> dict[str, Any]:
    embedding, blocks, head = moe.build(MOE_SPEC)
    cfg = PipelineConfig(schedule=schedule, num_microbatches=MICRO, fb_overlap=overlap,
                         data_parallel=DataParallelConfig(zero_stage=stage))
    pipe = Pipeline.from_layers(blocks, moe.loss_fn, moe.adamw, cfg, embedding=embedding, head=head,
                                mesh=make_mesh(pp, 4 // pp, ep=2))
    losses = [pipe.step(*moe.batch(step, pipe.groups.dp_rank)) for step in range(STEPS)]
    ref = moe.Reference(MOE_SPEC)
    want = [ref.step(step, 4 // pp, MICRO) for step in range(STEPS)]
    parts = ref.parts(pipe.partition)
    worst, experts, state = 0.0, 0, {}
    for s, module in sorted(pipe.stage_modules.items()):
        ref_params = dict(parts[pipe.schedule.stages[s].group].named_parameters())
        for name, p in inner_module(module).named_parameters():
            got, expected = _full(p), ref_params[name].detach()
            worst = max(worst, float((got - expected).abs().max() / expected.abs().max()))
            experts += "experts." in name
            state[f"{s}.{name}"] = got.tolist()
    try:
        pipe.dp.checkpoint_dicts(pipe.stage_state_modules)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"loss_rel": max_rel(losses, want), "param_rel": worst, "experts": experts, "state": state,
            "overlap": pipe.runtime.config.fb_overlap, "strategy": type(pipe.dp).__name__, "refused": refused}


def _squares(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).mean()


def _dense_parts(schedule: str) -> list[nn.Module]:
    return list(make_parts(resolve_schedule(with_defaults(PipelineConfig(schedule, MICRO)), 2).num_groups, 8, 0))


def _dense_case(schedule: str, fields: dict[str, Any]) -> dict[str, Any]:
    cfg = PipelineConfig(schedule, MICRO, grad_clip_norm=CLIP, data_parallel=DataParallelConfig(zero_stage=3),
                         **fields)
    pipe = Pipeline(_dense_parts(schedule), _squares, adamw, cfg, mesh=make_mesh(2, 2))
    calls = fields.get("accumulation_steps", 1)
    for step in range(STEPS):
        for call in range(calls):
            pipe.step(*local_batch(pipe, step * calls + call))
    parts = _dense_parts(schedule)  # one process: each optimizer step on the mean loss of its calls' batches
    model = nn.Sequential(*parts)
    opt = adamw(list(model.parameters()))
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys = zip(*(batch(step * calls + call, 16) for call in range(calls)), strict=True)
        _squares(model(torch.cat(xs)), torch.cat(ys)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    groups = [pipe.schedule.stages[s].group for s in sorted(pipe.stage_state_modules)]
    want = torch.cat([p.detach().reshape(-1) for g in groups for p in parts[g].parameters()]).tolist()
    return {"rel": max_rel(flat_params(pipe), want), "gathers": dict(pipe.dp.comms.gathers),
            "scatters": dict(pipe.dp.comms.scatters), "stages": sorted(pipe.stage_modules)}


def _worker() -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    try:
        return {"ep": {name: _guarded(lambda c=case: _ep_case(*c)) for name, case in EP_CASES.items()},
                "dense": {name: _guarded(lambda c=case: _dense_case(*c)) for name, case in DENSE_CASES.items()}}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="module")
def tp_results() -> list[dict[str, Any]]:
    from duplexpipe.launch.processes import launch
    return launch(_tp_worker, 8, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    from duplexpipe.launch.processes import launch
    return launch(_worker, 4, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def tp_want() -> list[float]:
    torch.set_default_dtype(torch.float64)
    try:
        return tpc.Reference().train(range(STEPS))
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(TP_CASES))
def test_zero3_with_tensor_parallelism_equals_one_process(tp_results: list[dict[str, Any]], tp_want: list[float],
                                                          name: str) -> None:
    """PP2 x DP2 x TP2, float64: FSDP2 shards the TP-sharded DTensors over "dp" (2-D parameters); the losses of 3
    clipped AdamW steps within 1e-10 of one process (with SP, and with a window of one stage on DualPipeV)."""
    for rank, res in enumerate(tp_results):
        got = res[name]
        assert "error" not in got, got.get("error")
        assert got["zero3"] == "Zero3Strategy" and got["tp_params"] > 0, (rank, got)
        assert tpc.max_rel(got["losses"], tp_want) <= 1e-10, (rank, got)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(EP_CASES))
def test_zero3_with_expert_parallelism_equals_one_process(results: list[dict[str, Any]], name: str) -> None:
    """MoE with ep=2 (balance loss and expert bias on): losses and every parameter (experts by global index)
    within 1e-10 of one process holding every expert, also with two replicas per expert (edp=2); ZeRO-2 through
    the same code."""
    for rank, res in enumerate(results):
        got = res["ep"][name]
        assert "error" not in got, got.get("error")
        assert got["strategy"] == ("Zero2Strategy" if "zero2" in name else "Zero3Strategy"), (rank, got["strategy"])
        assert got["experts"] > 0, (rank, got["experts"])
        assert got["loss_rel"] <= 1e-10 and got["param_rel"] <= 1e-10, (rank, got["loss_rel"], got["param_rel"])
        assert got["overlap"] == ("overlap" in name), (rank, got["overlap"])


@pytest.mark.timeout(60)
def test_zero3_the_overlap_is_bit_equal_with_experts(results: list[dict[str, Any]]) -> None:
    """DualPipeV on the MoE model: the F&B overlap changes no bit of the parameters under ZeRO-3."""
    for res in results:
        assert res["ep"]["dualpipev overlap"]["state"] == res["ep"]["dualpipev"]["state"]


@pytest.mark.timeout(60)
def test_zero3_checkpoints_with_experts_are_refused(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert "checkpoints of zero_stage=3 with MoE experts are not supported yet" in res["ep"]["1f1b"]["refused"]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_zero3_with_compile_checkpointing_and_accumulation(results: list[dict[str, Any]], name: str) -> None:
    """PP2 x DP2 float64 within 1e-10 of one process: compiled blocks (aot_eager), activation checkpointing on
    ZBV (two stages per rank), and accumulation_steps=2 (the window's calls summed, then one reduce-scatter per
    stage per optimizer step)."""
    for rank, res in enumerate(results):
        got = res["dense"][name]
        assert "error" not in got, got.get("error")
        assert got["rel"] <= 1e-10, (rank, got)
        if name == "accumulation":
            assert got["scatters"] == {s: STEPS for s in got["stages"]}, got
