"""Tests for duplexpipe.pipeline.launch: local launcher, crash reporting, torchrun (one and two nodes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from duplexpipe.pipeline.launch import LaunchError, free_port, launch, launched_by_torchrun

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _sum_ranks(offset: int) -> tuple[int, int, int]:
    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), int(t.item())


def _crash_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("boom from the test")
    dist.barrier()  # the others would wait forever; the launcher must kill them
    time.sleep(600)


def _hard_exit_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)  # no traceback, no report: the launcher must notice the dead process
    dist.barrier()
    time.sleep(600)


def _children() -> list[int]:
    """Pids of live (non-zombie) processes whose parent is this process.

    multiprocessing's own resource tracker (one per parent, exits with it) is not counted.
    """
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.timeout(60)
def test_launch_returns_every_rank_result() -> None:
    assert launch(_sum_ranks, 2, (10,)) == [(0, 2, 21), (1, 2, 21)]
    assert _children() == []


@pytest.mark.timeout(60)
def test_launch_reports_the_crashing_rank_and_leaves_no_process() -> None:
    with pytest.raises(LaunchError, match="rank 1 failed") as info:
        launch(_crash_on_rank_one, 2)
    assert info.value.rank == 1
    assert "RuntimeError: boom from the test" in info.value.details
    assert _children() == []


@pytest.mark.timeout(60)
def test_launch_names_a_rank_that_dies_without_a_report() -> None:
    with pytest.raises(LaunchError, match="rank 1 exited with code 3 without reporting a result") as info:
        launch(_hard_exit_on_rank_one, 2)
    assert info.value.rank == 1
    assert _children() == []


def test_launch_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="nprocs must be >= 1, got 0"):
        launch(_sum_ranks, 0)


def _torchrun(extra: list[str], port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    cmd = [str(TORCHRUN), *extra, "--master-addr", "127.0.0.1", "--master-port", str(port),
           str(ROOT / "examples" / "train_sequential.py"), "--steps", "3", "--json"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rank0_json(outputs: list[str]) -> dict[str, object]:
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, outputs
    return json.loads(lines[0])


@pytest.mark.timeout(120)
def test_torchrun_single_node_and_two_nodes() -> None:
    assert not launched_by_torchrun()
    one = _torchrun(["--nproc-per-node", "2"], free_port())
    out, err = one.communicate(timeout=100)
    assert one.returncode == 0, err[-3000:]
    result = _rank0_json([out])
    assert result["world"] == 2 and len(result["losses"]) == 3

    port = free_port()
    nodes = [_torchrun(["--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1"], port)
             for r in (0, 1)]
    outs = [p.communicate(timeout=100) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [e[-3000:] for _, e in outs]
    two = _rank0_json([o for o, _ in outs])
    assert two["world"] == 2
    assert two["losses"] == result["losses"]
