"""Tests for duplexpipe.tp.parallelize's construction-time checks on 2 gloo ranks that hold different model parts
(one pipeline, sharded over a TP mesh of the same two ranks): a plan key no rank's part has and an error found on
one rank only, TP-partial gradients under ZeRO-2 on one rank only, and tied copies sharded differently on two
ranks are each refused on every rank with the same ValueError (agreed by tensor collectives over the pipeline
group); a plan every rank can apply shards each rank's part. Without a process group: MoE balance losses under
sequence parallelism refused, naming the stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel

from duplexpipe.moe.layer import MoELayer
from duplexpipe.tp.parallelize import TensorParallel
from duplexpipe.tp.style import ReplicatedWithGradAllReduce


@dataclass(frozen=True)
class _Groups:
    """One pipeline of the world's ranks (the default group), its TP mesh over the same ranks."""

    tp_mesh: Any
    tp_size: int = 2
    dp_size: int = 2
    pp_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None


def _error(make: Any) -> str | None:
    try:
        make()
    except ValueError as exc:
        return str(exc)
    return None


def _apply(mesh: DeviceMesh, plan: Any, part: nn.Module, zero_stage: int = 0) -> TensorParallel:
    tensor = TensorParallel(plan, _Groups(mesh), sequence_parallel=False)
    tensor.apply({dist.get_rank(): [part]}, zero_stage)
    return tensor


def _worker(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    mine = nn.Sequential()
    mine.add_module("b" if rank else "a", nn.Linear(4, 4 if rank else 3))
    plan = {"a": ColwiseParallel(), "b": ColwiseParallel(), "c": ColwiseParallel()}
    out["missing"] = _error(lambda: _apply(mesh, plan, mine))
    good = nn.Sequential()
    good.add_module("b" if rank else "a", nn.Linear(4, 4))
    _apply(mesh, {"a": ColwiseParallel(), "b": ColwiseParallel()}, good)
    out["sharded"] = isinstance(good[0].weight, DTensor) and good[0].weight.to_local().shape[0] == 2
    partial = nn.Sequential(nn.LayerNorm(4)) if rank == 0 else nn.Sequential(nn.Linear(4, 4))
    out["zero2"] = _error(lambda: _apply(mesh, {"0": ReplicatedWithGradAllReduce()}, partial, zero_stage=2))
    tensor = TensorParallel({}, _Groups(mesh), sequence_parallel=False)
    out["tied"] = _error(lambda: tensor.check_tied([["(Shard(dim=0),)"] if rank else ["whole"]]))
    out["tied alike"] = _error(lambda: tensor.check_tied([["(Shard(dim=0),)"]]))
    return out


def test_a_plan_error_on_one_rank_is_refused_on_every_rank_alike(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["missing"] == results[0]["missing"]
        assert res["missing"] == ("tp_plan cannot shard the model at TP degree 2: it names module(s) ['c'] that no "
                                  "model part has; part 0 module 'a' (Linear) has out_features=3, not divisible by "
                                  "the TP degree 2")
        assert res["sharded"]


def test_partial_gradients_under_zero2_on_one_rank_are_refused_on_every_rank(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["zero2"] is not None and res["zero2"].startswith(
            "zero_stage=2 with modules whose parameters' gradients are partial over the TP group")


def test_tied_copies_sharded_differently_are_refused_on_every_rank(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["tied"] == ("tied parameter 0 is sharded differently by the tp_plan in the parts that use it "
                               "((Shard(dim=0),), whole); give every module that uses it the same layout (e.g. a "
                               "vocabulary-parallel embedding, RowwiseParallel, with a column-parallel head) or "
                               "untie it")
        assert res["tied alike"] is None


def test_a_moe_balance_loss_under_sequence_parallelism_is_refused_naming_the_stage() -> None:
    layer = MoELayer(4, 8, 4, 2, aux_loss_coef=0.01)
    tensor = TensorParallel(lambda part, mesh: None, _Groups(object()), sequence_parallel=True)
    with pytest.raises(ValueError, match=r"stage 3 holds MoE layers with aux_loss_coef=0.01 under sequence "
                                         r"parallelism: each TP rank routes only its sequence shard"):
        tensor.apply({3: [nn.Sequential(layer)]})
    TensorParallel(lambda part, mesh: None, _Groups(object()), sequence_parallel=False).apply(
        {3: [nn.Sequential(MoELayer(4, 8, 4, 2, aux_loss_coef=0.01))]})
    TensorParallel(lambda part, mesh: None, _Groups(object()), sequence_parallel=True).apply(
        {3: [nn.Sequential(MoELayer(4, 8, 4, 2))]})  # no balance loss: exact under SP
