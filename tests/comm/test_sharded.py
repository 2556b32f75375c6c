"""Tests for duplexpipe.comm.sharded: ZeRO's reduce-scatter and all-gather (exact, bf16/fp16, int8 qgZ/qwZ)
on gloo, in one spawn of 4 ranks: every case runs on the world group and on two 2-rank groups."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import run_workers
from torch import Tensor

from duplexpipe.comm import C10dCounter, WireMeter
from duplexpipe.comm.quantize import quantize_int8
from duplexpipe.comm.sharded import ShardComm
from duplexpipe.dp_options.compression import (
    DGCOptions,
    Int8Options,
    PowerSGDOptions,
    TopKOptions,
    check_sharded,
    compression_options,
)

SPAWN_TIMEOUT_S = 180
CHUNK = 1000  # elements each rank owns: not a multiple of the 256-element int8 block


def _data(seed: int, rank: int, numel: int, scale: float = 1.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(numel, generator=gen) * scale


def _identical(t: Tensor, group: Any) -> bool:
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(lo, t) and torch.equal(hi, t))


def _exact_cases(group: Any) -> dict[str, Any]:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    comm = ShardComm(group)
    flat = _data(1, rank, n * CHUNK)
    out = torch.empty(CHUNK)
    comm.reduce_scatter(flat, out).finish()
    summed = flat.clone()
    dist.all_reduce(summed, group=group)
    want = summed.div_(n)[rank * CHUNK:(rank + 1) * CHUNK]
    gathered = torch.zeros(n * CHUNK)
    gathered[rank * CHUNK:(rank + 1) * CHUNK] = out
    comm.all_gather(gathered, gathered[rank * CHUNK:(rank + 1) * CHUNK]).finish()  # in place
    return {"rs_equals_all_reduce": torch.equal(out, want), "ag_equals_all_reduce": torch.equal(gathered, summed),
            "ring_bytes": comm.meter.snapshot()}


def _cast_cases(group: Any) -> dict[str, float]:
    """Relative error vs the exact mean: 0 on inputs 16 bits hold exactly, small on random inputs."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    out: dict[str, float] = {}
    for method in ("bf16", "fp16"):
        comm = ShardComm(group, gradients=compression_options(method))
        for name, flat in (("exact", torch.randint(-16, 17, (n * CHUNK,),
                                                   generator=torch.Generator().manual_seed(rank)).float() / 8),
                           ("random", _data(2, rank, n * CHUNK))):
            got = torch.empty(CHUNK)
            comm.reduce_scatter(flat, got).finish()
            mean = flat.clone()
            dist.all_reduce(mean, group=group)
            want = mean.div_(n)[rank * CHUNK:(rank + 1) * CHUNK]
            out[f"{method}_{name}"] = float((got - want).abs().max() / want.abs().max())
    return out


def _qgz_case(group: Any) -> dict[str, Any]:
    """int8 reduce-scatter where the ranks' gradients differ 1000x in magnitude: within the bound of
    dequantize-then-sum (mean over ranks of each rank's block scale)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    opts = Int8Options(block=256)
    comm = ShardComm(group, gradients=opts)
    flat = _data(3, rank, n * CHUNK, scale=1000.0 ** (rank % 2))
    got = torch.empty(CHUNK)
    comm.reduce_scatter(flat, got, draw=7).finish()
    exact = flat.double()
    dist.all_reduce(exact, group=group)
    want = exact.div_(n)[rank * CHUNK:(rank + 1) * CHUNK]
    scales = []
    for r in range(n):  # every rank's own scales for this rank's chunk (each chunk padded to whole blocks)
        theirs = _data(3, r, n * CHUNK, scale=1000.0 ** (r % 2))[rank * CHUNK:(rank + 1) * CHUNK]
        _, s = quantize_int8(torch.cat([theirs, theirs.new_zeros(1024 - CHUNK)]), 256)
        scales.append(s.repeat_interleave(256)[:CHUNK].double())
    bound = sum(scales) / n
    return {"ratio": float(((got.double() - want).abs() / bound).max()),
            "lossy": bool((got.double() != want).any())}


def _qwz_case(group: Any) -> dict[str, Any]:
    """int8 all-gather: every rank (the owner too) ends with the same bytes, within scale/2 of the shards."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    comm = ShardComm(group, weights=Int8Options(block=256, stochastic=False))
    shard = _data(4, rank, CHUNK, scale=10.0 ** rank)
    out = torch.empty(n * CHUNK)
    comm.all_gather(out, shard).finish()
    worst = 0.0
    for r in range(n):
        theirs = _data(4, r, CHUNK, scale=10.0 ** r)
        _, s = quantize_int8(theirs, 256)
        err = (out[r * CHUNK:(r + 1) * CHUNK] - theirs).abs() / (s.repeat_interleave(256)[:CHUNK] / 2)
        worst = max(worst, float(err.max()))
    return {"ratio": worst, "identical": _identical(out, group), "lossy": not torch.equal(out[rank * CHUNK:(rank + 1)
            * CHUNK], shard)}


def _segments(n: int) -> list[list[int]]:
    """Per rank, a short run near 1 (a LayerNorm weight), then runs near 0.01; the cuts differ by rank."""
    return [[10 + 7 * r, 300, CHUNK - 310 - 7 * r] for r in range(n)]


def _segmented_data(seed: int, rank: int, cuts: list[int]) -> Tensor:
    parts = [_data(seed, rank * 10 + i, length, scale=1.0 if i == 0 else 0.01) for i, length in enumerate(cuts)]
    parts[0] = parts[0].abs() + 0.5
    return torch.cat(parts)


def _segment_scales(x: Tensor, cuts: list[int]) -> Tensor:
    """Per element, the scale of its block when each run is cut into blocks of 256 on its own."""
    out = [quantize_int8(part, 256)[1].repeat_interleave(256)[:part.numel()] for part in x.split(cuts)]
    return torch.cat(out)


def _segment_case(group: Any) -> dict[str, Any]:
    """int8 blocks inside segments: every element within its own run's half scale (qwZ) or mean scale (qgZ),
    where blocks across the runs would not be; replicas identical; bytes as counted by the dispatcher."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    cuts = _segments(n)
    comm = ShardComm(group, gradients=Int8Options(block=256), weights=Int8Options(block=256, stochastic=False))
    seen = WireMeter()
    with C10dCounter(seen):
        out = torch.empty(n * CHUNK)
        comm.all_gather(out, _segmented_data(6, rank, cuts[rank]), segments=cuts).finish()
        grads = torch.cat([_segmented_data(7, rank + 100 * r, cuts[r]) for r in range(n)])
        got = torch.empty(CHUNK)
        comm.reduce_scatter(grads, got, draw=3, segments=cuts).finish()
    fixed = torch.empty(n * CHUNK)
    ShardComm(group, weights=Int8Options(block=256, stochastic=False)).all_gather(
        fixed, _segmented_data(6, rank, cuts[rank])).finish()
    qwz, fixed_qwz = 0.0, 0.0
    for r in range(n):
        theirs = _segmented_data(6, r, cuts[r])
        half = _segment_scales(theirs, cuts[r]) / 2
        qwz = max(qwz, float(((out[r * CHUNK:(r + 1) * CHUNK] - theirs).abs() / half).max()))
        fixed_qwz = max(fixed_qwz, float(((fixed[r * CHUNK:(r + 1) * CHUNK] - theirs).abs() / half).max()))
    exact = grads.double()
    dist.all_reduce(exact, group=group)
    want = exact.div_(n)[rank * CHUNK:(rank + 1) * CHUNK]
    bound = sum(_segment_scales(_segmented_data(7, r + 100 * rank, cuts[rank]), cuts[rank]).double()
                for r in range(n)) / n
    with pytest.raises(ValueError, match="summing to the chunk of 1000 elements"):
        comm.all_gather(out, torch.zeros(CHUNK), segments=[[CHUNK - 1]] * n)
    return {"qwz": qwz, "fixed_qwz": fixed_qwz, "identical": _identical(out, group),
            "qgz": float(((got.double() - want).abs() / bound).max()), "own": comm.meter.snapshot(),
            "dispatch": seen.snapshot()}


def _meter_case(group: Any) -> dict[str, Any]:
    """Each wire format's ring-model bytes, by its own meter and by the c10d dispatch counter."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = 256 * 40
    out: dict[str, Any] = {}
    for name, kwargs in (("fp32", {}), ("bf16", {"gradients": compression_options("bf16")}),
                         ("int8", {"gradients": Int8Options(), "weights": Int8Options()})):
        comm = ShardComm(group, **kwargs)  # type: ignore[arg-type]
        seen = WireMeter()
        with C10dCounter(seen):
            flat, shard, full = _data(5, rank, n * chunk), torch.empty(chunk), torch.empty(n * chunk)
            comm.reduce_scatter(flat, shard).finish()
            comm.all_gather(full, shard).finish()
        out[name] = {"own": comm.meter.snapshot(), "dispatch": seen.snapshot()}
    return out


def _cases(group: Any) -> dict[str, Any]:
    return {"exact": _exact_cases(group), "cast": _cast_cases(group), "qgz": _qgz_case(group),
            "qwz": _qwz_case(group), "meter": _meter_case(group), "segments": _segment_case(group)}


def _worker(rank: int, world: int) -> dict[int, dict[str, Any]]:
    torch.manual_seed(rank)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return {4: _cases(None), 2: _cases(pairs[rank // 2])}


@pytest.fixture(scope="module")
def results() -> list[dict[int, dict[str, Any]]]:
    return run_workers(_worker, 4, timeout_s=SPAWN_TIMEOUT_S)


def _each(results: list[dict[int, dict[str, Any]]], key: str) -> list[tuple[int, int, Any]]:
    return [(rank, n, r[n][key]) for rank, r in enumerate(results) for n in (2, 4)]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_exact_reduce_scatter_and_all_gather_equal_the_all_reduce_bit_for_bit(results: Any) -> None:
    """gloo's reduce-scatter sums each element in the order its all-reduce does (2 and 4 ranks); the
    all-gather may take a shard that is this rank's own chunk of the output (in place)."""
    for rank, n, m in _each(results, "exact"):
        assert m["rs_equals_all_reduce"] and m["ag_equals_all_reduce"], (rank, n)
        buffer = n * CHUNK * 4
        assert m["ring_bytes"]["bytes"] == {"reduce_scatter": (n - 1) / n * buffer, "all_gather": (n - 1) / n * buffer}


@pytest.mark.timeout(60)
def test_cast_reduce_scatter_is_exact_on_representable_inputs_and_close_otherwise(results: Any) -> None:
    for rank, n, m in _each(results, "cast"):
        assert m["bf16_exact"] == 0.0 and m["fp16_exact"] == 0.0, (rank, n, m)
        assert 0.0 < m["bf16_random"] < 2**-7 and 0.0 < m["fp16_random"] < 2**-9, (rank, n, m)


@pytest.mark.timeout(60)
def test_qgz_dequantizes_before_summing_even_when_ranks_differ_1000x(results: Any) -> None:
    for rank, n, m in _each(results, "qgz"):
        assert m["lossy"] and m["ratio"] <= 1.0, (rank, n, m)


@pytest.mark.timeout(60)
def test_qwz_replicas_get_identical_weights_within_half_a_scale(results: Any) -> None:
    for rank, n, m in _each(results, "qwz"):
        assert m["identical"] and m["lossy"] and m["ratio"] <= 1.0 + 1e-6, (rank, n, m)


@pytest.mark.timeout(60)
def test_wire_bytes_match_the_dispatch_count_and_int8_saves_over_3_5x(results: Any) -> None:
    for rank, n, m in _each(results, "meter"):
        for name in ("fp32", "bf16", "int8"):
            assert m[name]["own"] == m[name]["dispatch"], (rank, n, name, m[name])
        fp32 = m["fp32"]["own"]["bytes"]
        int8 = m["int8"]["own"]["bytes"]
        assert fp32["reduce_scatter"] / int8["all_to_all"] >= 3.5, (rank, n, fp32, int8)  # qgZ
        assert fp32["all_gather"] / int8["all_gather"] >= 3.5, (rank, n, fp32, int8)  # qwZ
        assert m["bf16"]["own"]["bytes"]["reduce_scatter"] * 2 == fp32["reduce_scatter"]


@pytest.mark.timeout(60)
def test_int8_blocks_inside_segments_keep_each_run_at_its_own_scale(results: Any) -> None:
    """With segments (a parameter's pieces), small weights beside a run near 1 keep their own scale (blocks
    across the runs miss that bound by far); the codes go unpadded, so the bytes stay over 3.5x below fp32."""
    for rank, n, m in _each(results, "segments"):
        assert m["qwz"] <= 1.0 + 1e-6 and m["fixed_qwz"] > 10.0 and m["identical"], (rank, n, m)
        assert m["qgz"] <= 1.0, (rank, n, m)
        assert m["own"] == m["dispatch"], (rank, n, m)
        scales = max(sum(-(-length // 256) for length in cuts) for cuts in _segments(n))
        row = CHUNK + 4 * scales
        want = {"all_gather": (n - 1) * row, "all_to_all": (n - 1) * row}
        assert m["own"]["bytes"] == pytest.approx(want), (rank, n, m)
        assert 4 * CHUNK / row >= 3.5


def test_methods_without_a_reduce_scatter_form_are_rejected_by_name() -> None:
    for spec in (TopKOptions(), DGCOptions(), PowerSGDOptions(), compression_options("randomk")):
        with pytest.raises(ValueError, match=f"gradient compression '{spec.method}' cannot be combined with ZeRO"):
            check_sharded(spec)
    assert check_sharded(compression_options("int8")) == Int8Options()
