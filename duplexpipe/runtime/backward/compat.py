"""The private torch names duplexpipe uses, each behind a plain name, checked at import against the torch versions
they were written for.

Every use of a torch name that is not public API (an underscore name of torch, of its C extension, of dynamo,
inductor or AOT autograd) goes through this module, so that a torch upgrade is checked in one place. Only the
compile backend (`train/compile.py`) adds none of its own: it calls these too. Imports of torch's compiler stack
stay inside the functions (dynamo costs about a second to import).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

WRITTEN_FOR = "2.13"
"""The torch release these names were written and tested against (CI's torch)."""
TESTED = ((2, 13), (2, 14))
"""The torch versions known to work: from the first (included) to the second (excluded), as pyproject.toml
declares them."""


def version_problem(version: str) -> str | None:
    """What is wrong with torch `version` for these names (None: inside `TESTED`)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return f"duplexpipe cannot read torch's version {version!r}; it was written for torch {WRITTEN_FOR}"
    major_minor = (int(found.group(1)), int(found.group(2)))
    low, high = TESTED
    if low <= major_minor < high:
        return None
    return (f"duplexpipe uses private torch names written for torch {WRITTEN_FOR} (tested: >={low[0]}.{low[1]},"
            f"<{high[0]}.{high[1]}), and torch {version} is installed: the split backward and compiled stages may "
            "fail or be wrong (duplexpipe/runtime/backward/compat.py lists the names)")


def check_torch_version(version: str = torch.__version__) -> None:
    """Warn (once per import, at import) when torch `version` is outside `TESTED`."""
    problem = version_problem(version)
    if problem is not None:
        warnings.warn(problem, UserWarning, stacklevel=2)


check_torch_version()


# ------------------------------------------------------------------------------------------- the autograd engine
ACCUMULATE_GRAD: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
"""The node type through which a leaf (a parameter, a stage input) receives its gradient; its `variable` is
the leaf."""


def current_autograd_node() -> Any:
    """The autograd node the engine is running now, on this thread (None outside a backward)."""
    return torch._C._current_autograd_node()


def run_engine(roots: Sequence[Any], grads: Sequence[Tensor], inputs: Sequence[Any], retain_graph: bool,
               accumulate: bool) -> tuple[Tensor | None, ...]:
    """One engine call from `roots` (tensors or gradient edges) started from `grads`, for `inputs`: their gradients
    returned (None: unreached), or, with `accumulate`, added into their .grad (nothing returned), as
    `torch.autograd.grad` / `torch.autograd.backward(inputs=...)` do, without their Python checks of the arguments
    (the engine checks the gradients against the roots again): the split backward makes several calls a microbatch."""
    from torch.autograd.graph import _engine_run_backward

    result: tuple[Tensor | None, ...] = _engine_run_backward(
        tuple(roots), tuple(grads), retain_graph, False, tuple(inputs), True, accumulate_grad=accumulate)
    return result


def will_engine_execute(node: Any) -> bool:
    """Whether the engine call running now will run `node` (asked from inside a backward)."""
    return bool(torch._C._will_engine_execute_node(node))


def autograd_function(node: Any) -> Any:
    """The autograd Function class whose backward `node` runs (None for a built-in node)."""
    return getattr(type(node), "_forward_cls", None)


def is_compiled_region(function: Any) -> bool:
    """Whether an autograd Function class is a region compiled by AOT autograd (torch.compile's)."""
    return hasattr(function, "_aot_id")


def compiled_backward(function: Any) -> Any:
    """The compiled backward of an AOT region's Function class (None until it is compiled)."""
    return getattr(function, "compiled_bw", None)


# -------------------------------------------------------------------------------------------------- AOT autograd
@contextlib.contextmanager
def without_donated_buffers() -> Iterator[None]:
    """Around an engine call that retains the graph: AOT's refusal to retain a region that donated buffers is
    lifted (the caller runs each region's backward once)."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(donated_buffer=False):
        yield


@contextlib.contextmanager
def split_compile_settings() -> Iterator[None]:
    """While a region compiles for a split backward: no donated buffers, the backward compiled with the forward,
    and no AOT autograd cache entry (it would hold an unsplit backward)."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(donated_buffer=False, force_non_lazy_backward_lowering=True,
                                enable_autograd_cache=False):
        yield


def flatten_subclasses(values: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """AOT's flattening of tensor subclasses (a DTensor into its local tensor and mesh): the flat values and,
    per flat value, the index of the value it came from."""
    from torch._functorch._aot_autograd.subclass_utils import unwrap_tensor_subclasses_with_indices_to_original

    return unwrap_tensor_subclasses_with_indices_to_original(list(values))


def is_wrapper_subclass(value: Any) -> bool:
    """Whether `value` is a tensor subclass that wraps other tensors (a DTensor)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return bool(is_traceable_wrapper_subclass(value))


def aot_eager(gm: Any, example_inputs: list[Any], bw_compiler: Callable[..., Any]) -> Any:
    """torch.compile's "aot_eager" backend with its backward compiled by `bw_compiler`."""
    from torch._dynamo.backends.debugging import aot_eager as backend

    return backend(gm, example_inputs, bw_compiler=bw_compiler)


def boxed_nop(graph: Any, example_inputs: list[Any]) -> Any:
    """A graph run as it is, in the boxed calling convention (aot_eager's compiler)."""
    from torch._dynamo.backends.debugging import boxed_nop as nop

    return nop(graph, example_inputs)


# ------------------------------------------------------------------------------------------------------ inductor
def inductor(gm: Any, example_inputs: list[Any], inner_compile: Callable[..., Any],
             config_patches: dict[str, Any]) -> Any:
    """torch.compile's "inductor" backend, each graph compiled by `inner_compile`."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches)


def inductor_compile_graph(graph: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's compiler of one graph (what `inductor`'s `inner_compile` wraps)."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(graph, example_inputs, **kwargs)


def inductor_settings(mode: str | None, options: dict[str, Any] | None, dynamic: bool | None) -> dict[str, Any]:
    """The inductor config torch.compile(mode=..., options=...) applies."""
    return dict(torch._TorchCompileInductorWrapper(mode, options, dynamic).config)  # type: ignore[attr-defined]


def inductor_mode_settings(mode: str) -> dict[str, Any]:
    """The inductor options a torch.compile mode turns on."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def cpp_compiler_problem() -> str | None:
    """Why inductor finds no C++ compiler for the CPU (None: it finds one)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - no compiler found
        return str(exc).strip() or type(exc).__name__
    return None


def has_triton() -> bool:
    """Whether triton (inductor's GPU code generator) is installed and usable."""
    from torch.utils._triton import has_triton as found

    return bool(found())


# --------------------------------------------------------------------------------------------------------- dynamo
def compiled_by_user(module: nn.Module) -> bool:
    """Whether `module` is torch.compile's wrapper or was compiled in place (`nn.Module.compile`)."""
    import torch._dynamo

    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or compiled_in_place(module)


def compiled_in_place(module: nn.Module) -> bool:
    """Whether `nn.Module.compile` was called on `module`."""
    return module._compiled_call_impl is not None


def compiled_graph_count() -> int:
    """How many graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def recompile_reasons() -> dict[Any, list[str]]:
    """Per code object, the reasons dynamo gave for recompiling it so far (the live table: read, never change)."""
    from torch._dynamo.utils import guard_failures

    return guard_failures


# ---------------------------------------------------------------------------------------------- foreach kernels
def foreach_norm(tensors: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """The L2 norm of each tensor, in `dtype`, in one fused pass."""
    return list(torch._foreach_norm(list(tensors), 2, dtype=dtype))


def foreach_mul_(tensors: Sequence[Tensor], factor: float) -> None:
    """Multiply each tensor by `factor` in place, in one fused pass."""
    torch._foreach_mul_(list(tensors), factor)


# ------------------------------------------------------------------------------- FSDP2's post-forward mesh (hpZ)
def post_forward_mesh(dp_mesh: Any, ranks: int) -> Any:
    """FSDP2's post-forward mesh info for `fully_shard(mesh=dp_mesh, reshard_after_forward=ranks)` (groups of `ranks`
    consecutive ranks of the 1-D `dp_mesh`), its process groups made by every rank of the job in one order.

    fully_shard makes them from this rank's data-parallel group alone, with `new_group` calls that every rank of
    the job must join with the same ranks: with several data-parallel groups (pipeline stages) those calls differ
    between the groups and hang (measured at PP=2 x DP=4). A collective: every rank calls it once, with its own
    group's mesh; ValueError when the groups do not split the job into equal parts.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    mine = [int(r) for r in dp_mesh.mesh.flatten().tolist()]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    groups = sorted({tuple(group) for group in every})
    if len(groups) * len(mine) != dist.get_world_size() or len({r for g in groups for r in g}) != dist.get_world_size():
        raise ValueError(f"hpZ needs data-parallel groups that split the job's {dist.get_world_size()} ranks into "
                         f"equal parts, got {groups}")
    table = torch.tensor(groups).view(len(groups), -1, ranks)
    job = DeviceMesh(dp_mesh.device_type, table, mesh_dim_names=("hpz_dp", "hpz_replicate", "hpz_shard"))
    return HSDPMeshInfo(job["hpz_replicate", "hpz_shard"], shard_mesh_dim=1, replicate_mesh_dim=0)


def give_post_forward_mesh(module: nn.Module, mesh: Any) -> None:
    """Give the parameters of the fully_shard-ed `module` (built with reshard_after_forward=False) the post-forward
    `mesh` (`post_forward_mesh`), as fully_shard(reshard_after_forward=int) would have: FSDP2 then reshards to it
    after each forward."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for group in state._fsdp_param_groups:
        group.post_forward_mesh_info = mesh
        for record in group.fsdp_params:
            record.post_forward_mesh_info = mesh
            record._init_sharded_post_forward_param_metadata(torch.empty(record._orig_size, device="meta"))


def take_post_forward_meshes(module: nn.Module) -> list[tuple[Any, Any]]:
    """(parameter group, post-forward mesh) for each FSDP2 parameter group of the fully_shard-ed `module` that has
    one (`fully_shard(reshard_after_forward=k)`), the mesh taken off its group: FSDP2 then reshards nothing after a
    forward, and the caller reshards to that mesh when it chooses (`reshard_post_forward`)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    taken = [(group, group.post_forward_mesh_info) for group in state._fsdp_param_groups
             if group.post_forward_mesh_info is not None and group.post_forward_mesh_info != group.mesh_info]
    for group, _ in taken:
        group.post_forward_mesh_info = None
    return taken


def reshard_post_forward(group: Any, mesh: Any) -> None:
    """Reshard an unsharded FSDP2 parameter group to its post-forward `mesh` as FSDP2's post-forward does (each
    rank keeps 1/k of the parameters; the group's next unshard gathers over that mesh only). A group that is not
    unsharded stays as it is."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    if not group.is_unsharded:
        return
    group.post_forward_mesh_info = mesh
    with group.use_training_state(TrainingState.FORWARD):
        group.reshard()


def settle_post_forward(group: Any) -> None:
    """Take the post-forward mesh off `group` again once it is no longer sharded over it (gathered, or sharded over
    its whole mesh), so FSDP2's own post-forward hook reshards nothing."""
    if not group.is_sharded_post_forward:
        group.post_forward_mesh_info = None


def free_post_forward(group: Any) -> None:
    """Shard `group` over its whole mesh and free any post-forward shard its parameters still hold (FSDP2's
    sharded state does not free one left by a post-forward reshard)."""
    group._to_sharded()
    for record in group.fsdp_params:
        record._sharded_post_forward_param = None
        record._sharded_post_forward_param_data = None
    group.post_forward_mesh_info = None


def post_forward_bytes(group: Any) -> int:
    """Bytes of the post-forward shards `group`'s parameters hold now."""
    return sum(record._sharded_post_forward_param_data.numel() * record._sharded_post_forward_param_data.element_size()
               for record in group.fsdp_params if getattr(record, "_sharded_post_forward_param_data", None) is not None)


# ----------------------------------------------------------------- FSDP2's parameter records (measured memory)
def fsdp_records(unit: nn.Module) -> list[Any]:
    """FSDP2's per-parameter records (FSDPParam) of the fully_shard-ed `unit` (a group of modules included), in
    its flat all-gather / reduce-scatter order; none of the units nested in it."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(unit)  # type: ignore[attr-defined]
    return [record for group in state._fsdp_param_groups for record in group.fsdp_params]


def nested_fsdp_records(module: nn.Module) -> list[Any]:
    """The FSDP2 records of every fully_shard unit in `module` (itself and the units nested in it), each once."""
    from torch.distributed.fsdp import FSDPModule

    seen: dict[int, Any] = {}
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            seen.update((id(record), record) for record in fsdp_records(sub))
    return list(seen.values())


@dataclass(frozen=True)
class FsdpHeld:
    """What FSDP2 holds now for the parameters of some records (`fsdp_held`)."""

    unsharded: list[Tensor]
    """The gathered parameters of the records whose group is unsharded now (their storage: the all-gather's
    output, padding included; a TP DTensor's local part)."""
    shards: list[Tensor]
    """The shards, always held (each the padded local shard FSDP2 all-gathers from), and hpZ's post-forward
    (node-local) shards while held."""
    grads: list[Tensor]
    """Gradients on any of them: the reduced shard's, and the unreduced gradient of the gathered parameter, kept
    after the group is resharded until its reduce-scatter."""
    managed: frozenset[int]
    """The ids of every parameter object FSDP2 puts on the modules (sharded, unsharded, post-forward)."""


def fsdp_held(records: Sequence[Any]) -> FsdpHeld:
    """The tensors FSDP2 holds now for `records` (`nested_fsdp_records`)."""
    unsharded: list[Tensor] = []
    shards: list[Tensor] = []
    grads: list[Tensor] = []
    managed: set[int] = set()
    for record in records:
        gathered = getattr(record, "unsharded_param", None)  # none before the record's first all-gather
        post_forward = getattr(record, "_sharded_post_forward_param", None)
        shards.append(record.sharded_param)
        if getattr(record, "_sharded_post_forward_param_data", None) is not None:
            shards.append(record._sharded_post_forward_param_data)
        if gathered is not None and record.sharded_state.name == "UNSHARDED":
            unsharded.append(gathered)
        for param in (record.sharded_param, gathered, post_forward):
            if param is not None:
                managed.add(id(param))
                if param.grad is not None:
                    grads.append(param.grad)
        if getattr(record, "unsharded_accumulated_grad", None) is not None:
            grads.append(record.unsharded_accumulated_grad)
    return FsdpHeld(unsharded, shards, grads, frozenset(managed))
