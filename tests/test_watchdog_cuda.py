"""The failure scenarios of test_watchdog on CUDA with NCCL: every rank stops, naming the failed rank
(skipped without 2 GPUs, or one with DUPLEXPIPE_SHARE_GPU=1).

Each scenario runs in fresh processes: after a failure on NCCL the failed step's transfers can stay
pending on the GPU, and a process that goes on can hang in its next first kernel launch (CUDA's lazy
module loading waits for the device's queued work). The runtime's error says to restart the processes.
"""

from __future__ import annotations

from typing import Any

import pytest
import test_watchdog as gloo_case
from models import nccl_ranks_fit, run_workers

SPAWN_TIMEOUT_S = 120


def _cuda_worker(rank: int, world: int, name: str) -> dict[str, Any]:
    return {name: gloo_case.run_scenario(rank, name, device="cuda")}


def _results(name: str) -> list[dict[str, Any]]:
    if not nccl_ranks_fit(2):
        pytest.skip("needs 2 CUDA GPUs (or one with DUPLEXPIPE_SHARE_GPU=1)")
    return run_workers(_cuda_worker, 2, (name,), SPAWN_TIMEOUT_S - 30, backend="nccl")


@pytest.mark.cuda
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
def test_timeout_names_rank_action_and_peer_and_stops_the_peer() -> None:
    results = _results("timeout")
    gloo_case.test_timeout_names_rank_action_and_peer_and_stops_the_peer(results)
    gloo_case.test_a_failed_runtime_refuses_further_steps(results, "timeout")


@pytest.mark.cuda
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
def test_timeout_of_a_receive_with_known_shape() -> None:
    results = _results("timeout_fast")
    gloo_case.test_timeout_of_a_receive_with_known_shape(results)
    gloo_case.test_a_failed_runtime_refuses_further_steps(results, "timeout_fast")


@pytest.mark.cuda
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
def test_exception_on_one_rank_ends_every_rank_naming_it() -> None:
    results = _results("exception")
    gloo_case.test_exception_on_one_rank_ends_every_rank_naming_it(results)
    gloo_case.test_a_failed_runtime_refuses_further_steps(results, "exception")


@pytest.mark.cuda
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
def test_wrong_activation_shape_names_stage_microbatch_and_shapes() -> None:
    results = _results("shape")
    gloo_case.test_wrong_activation_shape_names_stage_microbatch_and_shapes(results)
    gloo_case.test_a_failed_runtime_refuses_further_steps(results, "shape")
