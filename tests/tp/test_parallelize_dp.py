"""Tests for duplexpipe.tp.parallelize with data and expert parallelism: PP=2 x DP=2 x TP=2 (8 gloo ranks, one
spawn; the data-parallel strategies and the expert-parallel all-to-alls need DP = 2 beside TP = 2), float64, against
one process: ZeRO-1 and ZeRO-2 (FSDP2 over the mesh's "dp" dimension) with sequence parallelism, and MoE blocks with
expert parallelism (ep=2) whose attention is tensor-parallel, with the F&B overlap on and off (bit-equal)."""

from __future__ import annotations

from typing import Any

import _moe_cases as moe
import pytest
import torch
import torch.distributed as dist
from _tp_cases import CLIP, STEPS, Reference, max_rel, pipeline, train

from duplexpipe import Pipeline, PipelineConfig, make_mesh
from duplexpipe.moe import moe_tp_plan
from duplexpipe.train.pipeline_config import DataParallelConfig

WORLD = 8
SPAWN_TIMEOUT_S = 420
DENSE = {"zero1 sp": {"data_parallel": DataParallelConfig(zero_stage=1), "sequence_parallel": True},
         "zero2 sp": {"data_parallel": DataParallelConfig(zero_stage=2), "sequence_parallel": True}}
MOE = {"sp overlap": (True, True), "sp no overlap": (True, False), "aux overlap": (False, True)}
"""name -> (sequence parallelism, F&B overlap); without SP the balance loss is on (it is refused under SP)."""


def _moe(sp: bool, overlap: bool) -> dict[str, Any]:
    spec = moe.MoESpec(heads=2, speed=0.01, aux=0.0 if sp else 0.01)
    embedding, blocks, head = moe.build(spec)
    pipe = Pipeline.from_layers(blocks, moe.loss_fn, moe.adamw, PipelineConfig("dualpipe", 4, sequence_parallel=sp,
                                                                               fb_overlap=overlap),
                                embedding=embedding, head=head, mesh=make_mesh(2, 2, tp=2, ep=2),
                                tp_plan=moe_tp_plan("layer*", sp, embedding="embedding", head="head"))
    losses = [pipe.step(*moe.batch(step, pipe.groups.dp_rank)) for step in range(STEPS)]
    groups = pipe.groups
    return {"groups": (sorted(dist.get_process_group_ranks(groups.dp_group)),
                       sorted(dist.get_process_group_ranks(groups.ep_group)),
                       sorted(dist.get_process_group_ranks(groups.tp_group))),
            "losses": losses, "state": {k: v.tolist() for k, v in moe.snapshot(
        {s: m for s, m in pipe.stage_modules.items()}).items() if "experts." in k or "router" in k}}


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    out: dict[str, Any] = {}
    for name, options in DENSE.items():
        out[name] = train(pipeline((2, 2, 2), PipelineConfig("1f1b", 4, grad_clip_norm=CLIP, **options)), range(STEPS))
    for name, (sp, overlap) in MOE.items():
        out[name] = _moe(sp, overlap)
    return out


@pytest.fixture(scope="module")
def want() -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    try:
        dense = Reference().train(range(STEPS))
        moes = {}
        for sp in (True, False):
            ref = moe.Reference(moe.MoESpec(heads=2, speed=0.01, aux=0.0 if sp else 0.01))
            moes[sp] = [ref.step(step, 2, 4) for step in range(STEPS)]
    finally:
        torch.set_default_dtype(torch.float32)
    return {"dense": dense, "moe": moes}


@pytest.mark.parametrize("name", list(DENSE))
def test_zero_with_tensor_parallelism_equals_one_process(results: list[dict[str, Any]], want: dict[str, Any],
                                                         name: str) -> None:
    for res in results:
        assert max_rel(res[name], want["dense"]) <= 1e-10


@pytest.mark.parametrize("name", list(MOE))
def test_moe_with_expert_and_tensor_parallelism_equals_one_process(results: list[dict[str, Any]],
                                                                   want: dict[str, Any], name: str) -> None:
    for res in results:
        assert max_rel(res[name]["losses"], want["moe"][MOE[name][0]]) <= 1e-10


def test_the_overlap_is_bit_equal_under_tensor_parallelism(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["sp overlap"] == res["sp no overlap"]


def test_experts_spread_over_ep_replicas_of_one_tp_coordinate(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):  # ("pp", "edp", "ep", "tp") = (2, 1, 2, 2): rank = (pp x 2 + ep) x 2 + tp
        pp, tp = rank // 4, rank % 2
        replicas = [pp * 4 + e * 2 + tp for e in range(2)]
        assert res["sp overlap"]["groups"] == (replicas, replicas, [rank - tp, rank - tp + 1])
