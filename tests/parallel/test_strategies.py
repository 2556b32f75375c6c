"""Tests for duplexpipe.parallel in training: strategies at PP=2 x DP=2 against a single-process reference,
bucket overlap on the DP lane, compression, fp16 skips, checkpoints, DP=1 and bad options.

Every multi-rank case runs in one launch of 4 gloo processes (module-scoped fixture, see _dp_cases.py).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _dp_cases import LOSSY, SCHEDULES, all_cases

from duplexpipe.dp_options.compression import DGCOptions, TopKOptions
from duplexpipe.launch.processes import launch
from duplexpipe.parallel import check_strategy_name
from duplexpipe.train.pipeline_config import DataParallelConfig
from duplexpipe.train.trainer import PipelineConfig

Results = list[dict[str, Any]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return launch(all_cases, 4, (str(tmp_path_factory.mktemp("dp")),), timeout_s=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_replicated_and_lossless_compressed_match_the_reference(results: Results, schedule: str) -> None:
    for rank, res in enumerate(results):
        exact, lossless = res[f"replicated/{schedule}"], res[f"lossless/{schedule}"]
        assert exact["strategy"] == "replicated" and lossless["strategy"] == "compressed"
        assert exact["loss_rel"] < 1e-5 and exact["param"] < 1e-4, (rank, exact)
        # top-k keeping every entry: the same sum over two ranks, the same bits as the all-reduce
        assert lossless["losses"] == exact["losses"], (rank, lossless["losses"], exact["losses"])
        assert torch.equal(lossless["params"], exact["params"]), rank
        # the fp32 ring all-reduce over 2 ranks sends 2 (n-1)/n = 1 times the gradient bytes per step
        assert exact["wire"] == [exact["fp32_ring_bytes"]] * len(exact["wire"]), (rank, exact["wire"])
        assert all(w == 2 * exact["fp32_ring_bytes"] for w in lossless["wire"])  # (value, index) slots


@pytest.mark.timeout(700)
def test_buckets_start_while_the_backward_still_runs(results: Results) -> None:
    for rank, res in enumerate(results):
        got = res["overlap"]
        assert got["buckets"] > 2 and got["bucket_spans"] == got["buckets"], (rank, got)
        assert got["lanes"] == ["dp", "exposed"] and got["waits"] == 1 and got["ordered"], (rank, got)
        # the window's end waited on each bucket once: its exposed communication, on lane "exposed"
        assert got["exposed_spans"] == sorted(f"bucket {i}" for i in range(got["buckets"])), (rank, got)
        assert got["exposed_buckets"] == list(range(got["buckets"])), (rank, got)
        # interleaved: a rank's later stage is final first; its buckets start before the earlier stage's
        # backward has run (program order, not timing)
        assert got["backward_after_first_start"], (rank, got["compute_after_first_start"])
        assert got["merged_span_ranks"] == [0, 1], (rank, got)


@pytest.mark.timeout(700)
def test_accumulated_windows_are_unscaled_before_compression(results: Results) -> None:
    for rank, res in enumerate(results):
        got = res["accumulation"]
        assert got["loss_rel"] < 1e-5 and got["param"] < 1e-4, (rank, got)


@pytest.mark.timeout(700)
def test_dgc_clips_each_replica_over_its_whole_model(results: Results) -> None:
    for rank, res in enumerate(results):
        got = res["dgc_local_clip"]
        assert got["min_norm"] > got["clip"], (rank, got)  # the clipping acted on every replica and step
        assert got["replica"] < 1e-6, (rank, got)  # the paper's rule: the replica's whole gradient
        # and not each stage (or bucket) by its own norm: that reference is 100x (and float32 noise) further
        assert got["stage"] > 100 * max(got["replica"], 1e-8), (rank, got)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", list(LOSSY))
def test_lossy_methods_train_with_identical_replicas(results: Results, name: str) -> None:
    for pp in (0, 1):
        a, b = results[2 * pp][f"lossy/{name}"], results[2 * pp + 1][f"lossy/{name}"]
        assert torch.equal(a["params"], b["params"]), (name, pp)  # the replicas stay bit-identical
    fp32 = results[0]["replicated/1f1b"]["fp32_ring_bytes"]
    for res in results:
        got = res[f"lossy/{name}"]
        assert got["method"] == "compressed"
        assert all(math.isfinite(v) for v in got["losses"]), got["losses"]
        assert got["losses"][-1] < got["losses"][0], (name, got["losses"])
        assert all(0 < w < fp32 for w in got["wire"][-2:]), (name, got["wire"], fp32)
    if name == "bf16":  # one all-reduce of 2-byte values
        assert results[0]["lossy/bf16"]["wire"] == [fp32 / 2] * len(results[0]["lossy/bf16"]["wire"])


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", ["int8", "dgc"])
def test_an_fp16_overflow_skips_the_step_and_leaves_residuals_untouched(results: Results, name: str) -> None:
    for rank, res in enumerate(results):
        got = res[f"fp16/{name}"]
        assert got["skipped"] == [False, False, True, False], (rank, got)
        assert got["state_kept"] == [False, False, True, False], (rank, got)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", ["int8", "powersgd", "dgc"])
def test_resume_from_a_checkpoint_is_exact(results: Results, name: str) -> None:
    for rank, res in enumerate(results):
        got = res[f"resume/{name}"]
        assert got["again"] == got["after"], (rank, got)
        assert got["params_equal"], rank


@pytest.mark.timeout(700)
def test_without_data_parallelism_compression_is_a_noop_with_one_warning(results: Results) -> None:
    for rank, res in enumerate(results):
        got = res["dp1"]
        assert len(got["messages"]) == 1 and "'int8' has no effect" in got["messages"][0], (rank, got)
        assert got["compressed"] == got["exact"] and got["strategy"] == "replicated" and got["wire"] == 0.0


@pytest.mark.timeout(700)
def test_sparsifiers_reject_adam_and_dgc_rejects_optimizer_momentum(results: Results) -> None:
    for res in results:
        assert "'topk' assumes SGD" in res["bad"]["topk_adam"] and "got Adam" in res["bad"]["topk_adam"]
        assert "allow_adaptive_optimizer=True" in res["bad"]["topk_adam"]
        assert "momentum 0.9 itself" in res["bad"]["dgc_momentum"] and "[0.9]" in res["bad"]["dgc_momentum"]


def test_config_rejects_bad_compression_options() -> None:
    with pytest.raises(ValueError, match="unknown gradient compression 'zstd'"):
        PipelineConfig(data_parallel=DataParallelConfig(grad_compression="zstd"))
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\], got 1.5"):
        PipelineConfig(data_parallel=DataParallelConfig(grad_compression=TopKOptions(ratio=1.5)))
    with pytest.raises(ValueError, match="grad_bucket_bytes must be an int >= 1, got 0"):
        PipelineConfig(data_parallel=DataParallelConfig(grad_bucket_bytes=0))
    with pytest.raises(ValueError, match="unknown dp_strategy 'zero9'"):
        PipelineConfig(data_parallel=DataParallelConfig(dp_strategy="zero9"))
    with pytest.raises(ValueError, match="'replicated' all-reduces exact gradients"):
        check_strategy_name("replicated", compressing=True)
    with pytest.raises(ValueError, match=r"grad_clip_norm=1.0 would clip DGC's averaged momentum-corrected"):
        PipelineConfig(grad_clip_norm=1.0, data_parallel=DataParallelConfig(grad_compression="dgc"))
    dgc = DataParallelConfig(grad_compression=DGCOptions(clip_norm=1.0))
    assert PipelineConfig(data_parallel=dgc).grad_clip_norm is None
    exact = PipelineConfig(data_parallel=DataParallelConfig(grad_compression="none"))
    assert exact.data_parallel.grad_compression == "none"
