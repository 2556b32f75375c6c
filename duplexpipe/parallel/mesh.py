"""Process groups for pipeline x data (x expert) parallelism, from a DeviceMesh ("pp", "dp") or ("pp", "edp", "ep")."""

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
    ep_group: dist.ProcessGroup | None = None
    """The expert-parallel group: the ep data-parallel replicas that spread each MoE layer's experts among
    them (None when ep_size is 1)."""
    ep_rank: int = 0
    """This process's index in its expert-parallel group."""
    ep_size: int = 1
    """Ranks an MoE layer's experts are spread over (divides dp_size)."""
    edp_group: dist.ProcessGroup | None = None
    """The expert-data-parallel group: the dp_size / ep_size replicas holding the same experts (their
    gradients are reduced over it, never over the expert-parallel group; None when its size is 1)."""
    edp_size: int = 1
    """Ranks holding the same experts."""

    @staticmethod
    def from_mesh(mesh: DeviceMesh | None) -> ParallelGroups:
        """Groups from a mesh with "pp" (and optionally "dp") dimensions; None: the world is one pipeline."""
        if mesh is None:
            if not (dist.is_available() and dist.is_initialized()):
                return ParallelGroups(None, 0, 1, None, 0, 1)
            return ParallelGroups(None, dist.get_rank(), dist.get_world_size(), None, 0, 1)
        names = tuple(mesh.mesh_dim_names or ())
        if names == ("pp", "edp", "ep"):
            return _expert_groups(mesh)
        extra = sorted(set(names) - {"pp", "dp"})
        if "pp" not in names or extra:
            raise ValueError(f"the mesh needs dimensions named 'pp' and optionally 'dp' (or 'pp', 'edp', 'ep' "
                             f"from make_mesh(pp, dp, ep=...)), got {names}")
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
        dp_size = dist.get_world_size(dp_group)  # no expert parallelism: every replica holds every expert
        return ParallelGroups(pp_group, pp_rank, pp_size, dp_group, mesh.get_local_rank("dp"), dp_size,
                              edp_group=dp_group, edp_size=dp_size)


def _expert_groups(mesh: DeviceMesh) -> ParallelGroups:
    """Groups of a ("pp", "edp", "ep") mesh: the data-parallel group is edp x ep (collective: every rank
    makes the same data-parallel groups)."""
    pp_group, pp_rank = mesh.get_group("pp"), mesh.get_local_rank("pp")
    pp_size, edp, ep = (int(n) for n in mesh.mesh.shape)
    rows = [[int(r) for r in mesh.mesh[p].reshape(-1)] for p in range(pp_size)]
    dp_group, _ = dist.new_subgroups_by_enumeration(rows)
    dp_rank = mesh.get_local_rank("edp") * ep + mesh.get_local_rank("ep")
    return ParallelGroups(pp_group, pp_rank, pp_size, dp_group, dp_rank, edp * ep,
                          mesh.get_group("ep"), mesh.get_local_rank("ep"), ep,
                          mesh.get_group("edp") if edp > 1 else None, edp)


def make_mesh(pp: int, dp: int = 1, device_type: str = "cpu", *, ep: int = 1) -> DeviceMesh:
    """A DeviceMesh over the initialised world: rank = pp_index * dp + dp_index.

    ep > 1 (expert parallelism, for models with MoE layers): each MoE layer's experts are spread over ep of
    the dp replicas of a pipeline rank (consecutive dp indices), so ep must divide dp; the mesh is then
    ("pp", "edp", "ep") with edp = dp / ep (the replicas holding the same experts). Otherwise ("pp", "dp").
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("make_mesh needs an initialised default process group (see launch / init_from_env)")
    world = dist.get_world_size()
    if pp < 1 or dp < 1 or pp * dp != world:
        raise ValueError(f"pp x dp = {pp} x {dp} = {pp * dp} must equal the world size {world}")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or dp % ep:
        raise ValueError(f"ep={ep!r} must be a positive int dividing dp={dp} (experts are spread over ep of "
                         "the data-parallel replicas)")
    if ep == 1:
        return init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))
    return init_device_mesh(device_type, (pp, dp // ep, ep), mesh_dim_names=("pp", "edp", "ep"))
