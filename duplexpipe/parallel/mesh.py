"""Process groups for pipeline x data x tensor (x expert) parallelism, from a DeviceMesh ("pp", "dp", "tp") or
("pp", "edp", "ep", "tp"), "tp" innermost and optional."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_FORMS = (("pp",), ("pp", "dp"), ("pp", "tp"), ("pp", "dp", "tp"), ("pp", "edp", "ep"), ("pp", "edp", "ep", "tp"))
"""The dimension names a Pipeline's mesh may have (make_mesh builds them)."""


@dataclass(frozen=True)
class ParallelGroups:
    """Where this process sits: its pipeline, data-parallel, tensor-parallel (and expert-parallel) groups and ranks.

    Every (dp, tp) coordinate has its own pipeline group: stage-to-stage messages go between ranks with equal
    data- and tensor-parallel coordinates."""

    pp_group: dist.ProcessGroup | None
    """The pipeline group (None: the default group)."""
    pp_rank: int
    """This process's rank in the schedule (its index along "pp")."""
    pp_size: int
    """Pipeline ranks, the schedule's num_ranks."""
    dp_group: dist.ProcessGroup | None
    """The data-parallel group: the replicas of this pipeline rank with this tensor-parallel rank (None when
    dp_size is 1)."""
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
    tp_group: dist.ProcessGroup | None = None
    """The tensor-parallel group: the tp_size neighbouring ranks that shard each stage's layers (None when
    tp_size is 1)."""
    tp_rank: int = 0
    """This process's index along "tp"."""
    tp_size: int = 1
    """Tensor-parallel degree (1: no tensor parallelism)."""
    tp_mesh: DeviceMesh | None = None
    """The mesh's 1-D "tp" sub-mesh, which `parallelize_module` shards over (None when tp_size is 1)."""
    dp_mesh: DeviceMesh | None = None
    """The mesh's 1-D "dp" sub-mesh (same root as tp_mesh: FSDP2 composes with TP over it); None without one."""

    @staticmethod
    def from_mesh(mesh: DeviceMesh | None) -> ParallelGroups:
        """Groups from a mesh of make_mesh's forms (`MESH_FORMS`); None: the world is one pipeline."""
        if mesh is None:
            if not (dist.is_available() and dist.is_initialized()):
                return ParallelGroups(None, 0, 1, None, 0, 1)
            return ParallelGroups(None, dist.get_rank(), dist.get_world_size(), None, 0, 1)
        names = tuple(mesh.mesh_dim_names or ())
        if names not in MESH_FORMS:
            raise ValueError(f"the mesh needs dimensions named as make_mesh(pp, dp, tp=..., ep=...) names them "
                             f"(one of {', '.join(map(str, MESH_FORMS))}), got {names}")
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
        if "ep" in names:
            return _with_tp(_expert_groups(mesh), mesh)
        pp_size = dist.get_world_size(pp_group)
        if "dp" not in names:
            return _with_tp(ParallelGroups(pp_group, pp_rank, pp_size, None, 0, 1), mesh)
        dp_group = mesh.get_group("dp")
        dp_size = dist.get_world_size(dp_group)  # no expert parallelism: every replica holds every expert
        return _with_tp(ParallelGroups(pp_group, pp_rank, pp_size, dp_group, mesh.get_local_rank("dp"), dp_size,
                                       edp_group=dp_group, edp_size=dp_size, dp_mesh=mesh["dp"]), mesh)


def _with_tp(groups: ParallelGroups, mesh: DeviceMesh) -> ParallelGroups:
    """`groups` with the tensor-parallel fields of a mesh with a "tp" dimension (unchanged without one)."""
    if "tp" not in (mesh.mesh_dim_names or ()):
        return groups
    tp_mesh = mesh["tp"]
    size = tp_mesh.size()
    return replace(groups, tp_group=mesh.get_group("tp") if size > 1 else None, tp_rank=mesh.get_local_rank("tp"),
                   tp_size=size, tp_mesh=tp_mesh if size > 1 else None)


def _expert_groups(mesh: DeviceMesh) -> ParallelGroups:
    """Groups of a ("pp", "edp", "ep"[, "tp"]) mesh: the data-parallel group is edp x ep at one (pp, tp)
    coordinate (collective: every rank makes the same data-parallel groups)."""
    pp_group, pp_rank = mesh.get_group("pp"), mesh.get_local_rank("pp")
    shape = [int(n) for n in mesh.mesh.shape]
    pp_size, edp, ep = shape[:3]
    grid = mesh.mesh if len(shape) == 4 else mesh.mesh.unsqueeze(-1)
    rows = [[int(r) for r in grid[p, :, :, t].reshape(-1)] for p in range(pp_size) for t in range(grid.shape[3])]
    dp_group, _ = dist.new_subgroups_by_enumeration(rows)
    dp_rank = mesh.get_local_rank("edp") * ep + mesh.get_local_rank("ep")
    return ParallelGroups(pp_group, pp_rank, pp_size, dp_group, dp_rank, edp * ep,
                          mesh.get_group("ep"), mesh.get_local_rank("ep"), ep,
                          mesh.get_group("edp") if edp > 1 else None, edp)


def make_mesh(pp: int, dp: int = 1, device_type: str = "cpu", *, tp: int = 1, ep: int = 1) -> DeviceMesh:
    """A DeviceMesh over the initialised world: rank = (pp_index * dp + dp_index) * tp + tp_index.

    tp > 1 (tensor parallelism inside each stage, `Pipeline(tp_plan=...)`): the innermost dimension "tp", so the
    ranks of one tensor-parallel group are neighbours (on one node in practice). ep > 1 (expert parallelism, for
    models with MoE layers): each MoE layer's experts are spread over ep of the dp replicas of a pipeline rank
    (consecutive dp indices), so ep must divide dp; the mesh is then ("pp", "edp", "ep"[, "tp"]) with
    edp = dp / ep (the replicas holding the same experts). Otherwise ("pp", "dp"[, "tp"]). Raises ValueError,
    before any collective, when pp x dp x tp is not the world size.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("make_mesh needs an initialised default process group (see launch / init_from_env)")
    world = dist.get_world_size()
    for name, value in (("pp", pp), ("dp", dp), ("tp", tp), ("ep", ep)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"make_mesh: {name}={value!r} must be a positive int")
    if pp * dp * tp != world:
        raise ValueError(f"pp x dp x tp = {pp} x {dp} x {tp} = {pp * dp * tp} must equal the world size {world}")
    if dp % ep:
        raise ValueError(f"ep={ep!r} must be a positive int dividing dp={dp} (experts are spread over ep of "
                         "the data-parallel replicas)")
    shape: tuple[int, ...] = (pp, dp) if ep == 1 else (pp, dp // ep, ep)
    names: tuple[str, ...] = ("pp", "dp") if ep == 1 else ("pp", "edp", "ep")
    if tp > 1:
        shape, names = (*shape, tp), (*names, "tp")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
