"""Process groups for pipeline x data parallelism, from a DeviceMesh with dimensions ("pp", "dp")."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelGroups:
    """Where this process sits: its pipeline group and rank, and its data-parallel group and rank."""

    pp_group: dist.ProcessGroup | None
    """The pipeline group (None: the default group)."""
    pp_rank: int
    """This process's rank in the schedule (its index along "pp")."""
    pp_size: int
    """Pipeline ranks, the schedule's num_ranks."""
    dp_group: dist.ProcessGroup | None
    """The data-parallel group: the replicas of this pipeline rank (None when dp_size is 1)."""
    dp_rank: int
    """This process's replica index along "dp"."""
    dp_size: int
    """Number of data-parallel replicas."""

    @staticmethod
    def from_mesh(mesh: DeviceMesh | None) -> ParallelGroups:
        """Groups from a mesh with "pp" (and optionally "dp") dimensions; None: the world is one pipeline."""
        if mesh is None:
            if not (dist.is_available() and dist.is_initialized()):
                return ParallelGroups(None, 0, 1, None, 0, 1)
            return ParallelGroups(None, dist.get_rank(), dist.get_world_size(), None, 0, 1)
        names = tuple(mesh.mesh_dim_names or ())
        extra = sorted(set(names) - {"pp", "dp"})
        if "pp" not in names or extra:
            raise ValueError(f"the mesh needs dimensions named 'pp' and optionally 'dp', got {names}")
        if mesh.mesh.numel() != dist.get_world_size():
            raise ValueError(
                f"the mesh covers {mesh.mesh.numel()} ranks but the world has {dist.get_world_size()}; "
                "a Pipeline needs a mesh over all ranks"
            )
        pp_group = mesh.get_group("pp")
        pp_rank = mesh.get_local_rank("pp")
        if dist.get_rank(pp_group) != pp_rank:
            raise ValueError(
                f"mesh 'pp' coordinate {pp_rank} differs from the group rank {dist.get_rank(pp_group)}")
        pp_size = dist.get_world_size(pp_group)
        if "dp" not in names:
            return ParallelGroups(pp_group, pp_rank, pp_size, None, 0, 1)
        dp_group = mesh.get_group("dp")
        return ParallelGroups(pp_group, pp_rank, pp_size, dp_group, mesh.get_local_rank("dp"),
                              dist.get_world_size(dp_group))


def make_mesh(pp: int, dp: int = 1, device_type: str = "cpu") -> DeviceMesh:
    """A ("pp", "dp") DeviceMesh over the initialised world: rank = pp_index * dp + dp_index."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("make_mesh needs an initialised default process group (see launch / init_from_env)")
    world = dist.get_world_size()
    if pp < 1 or dp < 1 or pp * dp != world:
        raise ValueError(f"pp x dp = {pp} x {dp} = {pp * dp} must equal the world size {world}")
    return init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))
