"""The comm reducers on gloo (reducers.py, hooks.py, reduction.py, and meter.py's dispatch cross-check),
all in one spawn of 4 ranks: every case runs on the world group and on two 2-rank groups ({0,1}, {2,3})."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from _comm_cases import (
    api_errors_case,
    dgc_per_tensor_case,
    dgc_warmup_case,
    ef_identity_case,
    fp8_wire_case,
    int8_magnitude_case,
    lossless_case,
    meter_case,
    ratio_case,
    rollback_resume_case,
)
from _ddp_hook_cases import ddp_contract_case, powersgd_index_case
from models import run_workers

from duplexpipe.comm.sparsify import keep_count

SPAWN_TIMEOUT_S = 240


def all_cases(group: Any, pairs: bool) -> dict[str, Any]:
    """Every case on `group` (the 2-rank-only ones when `pairs`)."""
    out: dict[str, Any] = {
        "lossless": lossless_case(group),
        "ef": ef_identity_case(group),
        "rollback": rollback_resume_case(group),
        "meter": meter_case(group),
        "dgc_warmup": dgc_warmup_case(group),
        "dgc_per_tensor": dgc_per_tensor_case(group),
        "ratio": ratio_case(group),
        "fp8_wire": fp8_wire_case(group),
    }
    if pairs:
        out["int8_magnitude"] = int8_magnitude_case(group)
        out["ddp"] = ddp_contract_case(group)
        out["powersgd_index"] = powersgd_index_case(group)
        out["api_errors"] = api_errors_case(group)
    return out

def _worker(rank: int, world: int) -> dict[str, Any]:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return {4: all_cases(None, pairs=False), 2: all_cases(pairs[rank // 2], pairs=True)}


@pytest.fixture(scope="module")
def results() -> list[dict[int, dict[str, Any]]]:
    return run_workers(_worker, 4, timeout_s=SPAWN_TIMEOUT_S)


def _each(results: list[dict[int, dict[str, Any]]], key: str, sizes: tuple[int, ...] = (2, 4)) -> list[Any]:
    return [(rank, n, r[n][key]) for rank, r in enumerate(results) for n in sizes]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_lossless_compression_gives_the_exact_mean(results: list[dict[int, dict[str, Any]]]) -> None:
    """ratio 1 (sparsifiers, DGC without momentum), full rank (PowerSGD), inputs that 16-bit floats or
    int8 codes hold exactly: every reducer equals the exact mean, on 2 and 4 ranks."""
    for rank, n, errors in _each(results, "lossless"):
        assert set(errors) == {"none", "bf16", "fp16", "int8", "topk", "randomk", "threshold", "dgc", "powersgd"}
        for kind in ("bf16", "fp16", "int8"):
            assert errors[kind] == 0.0, (rank, n, kind, errors[kind])
        for kind in ("none", "topk", "randomk", "threshold", "dgc"):
            assert errors[kind] <= 1e-14, (rank, n, kind, errors[kind])  # float64, summation order only
        assert errors["powersgd"] <= 1e-10, (rank, n, errors["powersgd"])  # orthogonalization rounding


@pytest.mark.timeout(60)
def test_error_feedback_is_exact_for_every_lossy_method(results: list[dict[int, dict[str, Any]]]) -> None:
    """Over 6 steps and 2 buckets: sum of means + mean residual == mean of summed gradients (float64,
    1e-12); the methods really were lossy; every replica got bit-identical means."""
    for rank, n, per_method in _each(results, "ef"):
        assert set(per_method) == {"int8", "topk", "randomk", "threshold", "dgc", "powersgd"}
        for kind, m in per_method.items():
            assert m["err"] <= 1e-12, (rank, n, kind, m)
            assert m["lossy"] and m["identical"], (rank, n, kind, m)


@pytest.mark.timeout(60)
def test_int8_stays_within_its_bound_when_ranks_differ_1000x(results: list[dict[int, dict[str, Any]]]) -> None:
    for rank, _, m in _each(results, "int8_magnitude", (2,)):
        assert m["ratio"] <= 1.0, (rank, m)
        assert m["naive_ratio"] > 10.0, (rank, m)  # summing codes under one scale would break the bound


@pytest.mark.timeout(60)
def test_skipped_steps_leave_no_trace_and_resume_is_exact(results: list[dict[int, dict[str, Any]]]) -> None:
    for rank, n, per_method in _each(results, "rollback"):
        assert set(per_method) == {"int8", "topk", "randomk", "threshold", "dgc", "powersgd"}
        for kind, m in per_method.items():
            assert m == {"rollback_exact": True, "resume_exact": True}, (rank, n, kind)


@pytest.mark.timeout(60)
def test_meter_matches_the_c10d_dispatch_count(results: list[dict[int, dict[str, Any]]]) -> None:
    for rank, n, per_method in _each(results, "meter"):
        for kind in ("none", "bf16", "fp16", "int8", "topk", "randomk", "threshold", "dgc", "powersgd"):
            m = per_method[kind]
            assert m["reducer"] == m["dispatch"], (rank, n, kind, m)
            assert m["reducer"]["total_bytes"] > 0
        # PowerSGD's compressed steps post their P and Q all-reduces from gloo callbacks: cross-checked
        # with a process-wide counting wrapper of dist.all_reduce instead
        m = per_method["powersgd_compressed"]
        assert m["reducer"] == m["wrapped"] and m["reducer"]["calls"] == {"all_reduce": 12}, (rank, n, m)


@pytest.mark.timeout(60)
def test_bytes_on_the_wire_per_method(results: list[dict[int, dict[str, Any]]]) -> None:
    """fp32 all-reduce bytes / method bytes on a 2^16-element bucket (ring model, per rank)."""
    numel = 1 << 16
    for rank, n, ratio in _each(results, "ratio"):
        assert ratio["bf16"] == 2.0
        assert 3.8 <= ratio["int8"] < 4.0, (rank, n, ratio)  # 1 byte + a 4-byte scale per 256 elements
        k = keep_count(numel, 0.01)
        assert ratio["topk"] == pytest.approx(2 * numel * 4 / (n * k * 8))  # all_gather of (value, index)


@pytest.mark.timeout(60)
def test_fp8_payloads_travel_as_uint8(results: list[dict[int, dict[str, Any]]]) -> None:
    for rank, n, m in _each(results, "fp8_wire"):
        assert m == {"e4m3": True, "e5m2": True}, (rank, n)


@pytest.mark.timeout(60)
def test_dgc_warmup_follows_the_sparsity_schedule(results: list[dict[int, dict[str, Any]]]) -> None:
    for rank, n, m in _each(results, "dgc_warmup"):
        assert m["got"] == m["want"], (rank, n, m)
        assert len(set(m["want"])) == 4  # 75%, 93.75%, 98.4375%, then the 99% target


@pytest.mark.timeout(60)
def test_dgc_selects_per_tensor(results: list[dict[int, dict[str, Any]]]) -> None:
    """selection="tensor": each tensor of a bucket gets its own k_i, even one 1000x smaller than its
    neighbour (top-k over the bucket, the default, gives it none): every rank zeroes exactly k_i velocity
    entries per tensor."""
    for rank, n, m in _each(results, "dgc_per_tensor"):
        assert m["bucket_zeroed"] == [m["bucket_k"], 0, 0], (rank, n, m)
        assert m["ks"] == [10, 2, 1], (rank, n, m)
        assert m["zeroed"] == [m["ks"], m["ks"]], (rank, n, m)  # masked: v is 0 where it was sent
        for counts in m["nonzero"]:  # the mean holds every rank's slots (k_i to n k_i entries per tensor)
            assert all(k <= c <= n * k for c, k in zip(counts, m["ks"], strict=True)), (rank, n, m)
        assert m["wire"] == [m["want_wire"]] * 2, (rank, n, m)  # float64 values + int32 indices


@pytest.mark.timeout(60)
def test_torch_hooks_on_bucket_stand_ins_equal_ddp(results: list[dict[int, dict[str, Any]]]) -> None:
    """The GradBucket contract: same inputs through real DDP buckets and through Bucket give bit-equal means."""
    for rank, _, m in _each(results, "ddp", (2,)):
        assert m["bf16"] == {"calls": 3, "equal_ddp": True, "equal_hand": True}, (rank, m)
        assert m["powersgd"]["equal_ddp"] and m["powersgd"]["calls"] == 5, (rank, m)
        assert m["powersgd"]["compressed"] == 3, (rank, m)  # 2 exact steps, then 3 compressed


@pytest.mark.timeout(60)
def test_powersgd_state_is_keyed_by_bucket_index(results: list[dict[int, dict[str, Any]]]) -> None:
    for rank, _, m in _each(results, "powersgd_index", (2,)):
        assert m == {"equal": True, "keys": [0, 5], "kept_keys": [0, 5]}, (rank, m)


@pytest.mark.timeout(60)
def test_misuse_errors_waits_and_finish_order(results: list[dict[int, dict[str, Any]]]) -> None:
    for rank, _, m in _each(results, "api_errors", (2,)):
        assert m["twice"] == ("RuntimeError: int8: bucket 2 was already started in this step "
                              "(call end_step() after each step)"), rank
        assert m["unfinished"] == "RuntimeError: int8: finish the reductions of buckets [2] before end_step()"
        assert m["method"] == "ValueError: state is for method 'topk', this reducer is 'int8'"
        assert "expected a non-empty flat contiguous floating buffer" in m["buffer"], m
        assert m["waited"] == "the int8 all_to_all of gradient bucket 2 / the int8 all_gather of gradient bucket 2"
        assert m["compute_s_positive"] == "True" and m["reverse_finish_equal"] == "True", m
