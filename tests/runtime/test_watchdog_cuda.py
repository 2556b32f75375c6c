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


CHECKS = {
    "timeout": gloo_case.test_timeout_names_rank_action_and_peer_and_stops_the_peer,
    "timeout_fast": gloo_case.test_timeout_of_a_receive_with_known_shape,
    "exception": gloo_case.test_exception_on_one_rank_ends_every_rank_naming_it,
    "shape": gloo_case.test_wrong_activation_shape_names_stage_microbatch_and_shapes,
}
"""Scenario -> the gloo test's checks of its results."""


@pytest.mark.cuda
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(CHECKS))
def test_every_rank_stops_naming_the_failed_rank_and_refuses_further_steps(name: str) -> None:
    results = _results(name)
    CHECKS[name](results)
    gloo_case.test_a_failed_runtime_refuses_further_steps(results, name)
