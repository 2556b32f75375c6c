"""Tests for duplexpipe.parallel.mesh (single process; the 2 x 2 mesh runs in test_trainer)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from duplexpipe.parallel.mesh import ParallelGroups, make_mesh


def test_without_a_process_group_the_pipeline_is_one_rank() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    groups = ParallelGroups.from_mesh(None)
    assert (groups.pp_rank, groups.pp_size, groups.dp_rank, groups.dp_size) == (0, 1, 0, 1)
    assert groups.pp_group is None and groups.dp_group is None


def test_make_mesh_needs_an_initialised_world() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValueError, match="needs an initialised default process group"):
        make_mesh(2, 2)
