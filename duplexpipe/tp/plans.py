"""Tensor-parallel plans: torch's `parallelize_module` on each model part over the "tp" sub-mesh, checked first."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from fnmatch import fnmatch
from typing import Protocol, runtime_checkable

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from duplexpipe.tp.style import PARTIAL_OVER_TP

HEAD_ATTRS = ("n_head", "heads", "num_heads", "num_attention_heads", "num_key_value_heads", "n_kv_heads")
"""Attributes naming an attention module's head counts: the TP degree must divide each (modules see local heads)."""
SEQUENCE_SHARDS = "sequence_shards"
"""A part attribute some parts read (Hugging Face parts): how many TP ranks share the sequence of its messages."""


@runtime_checkable
class CheckedPlan(Protocol):
    """A callable plan that can also check the whole model's parts before any is parallelised."""

    def __call__(self, part: nn.Module, tp_mesh: DeviceMesh) -> None:
        """Parallelise `part` in place over `tp_mesh`."""

    def check(self, parts: Sequence[nn.Module], tp: int) -> None:
        """ValueError naming module, size and degree when `tp` cannot shard `parts` (all of the model's parts)."""


TPPlan = Mapping[str, ParallelStyle] | Callable[[nn.Module, DeviceMesh], None]
"""A tensor-parallel plan: what `parallelize_module` takes ({"layer*.attn.q": ColwiseParallel(), ...}, fnmatch
patterns over module paths, applied to every part that has the module), or a callable (part, tp_mesh) -> None for
full control (a `CheckedPlan` also checks the model first)."""
Restyle = Callable[[str, nn.Module, ParallelStyle], ParallelStyle]
"""restyle(path, module, style) -> the style a dict plan's entry applies to that module (float8 compute swaps torch's
plain styles for torchao's float8 ones: `train.float8_tp.Float8Styles`)."""


def resolve(module: nn.Module, pattern: str) -> Iterator[tuple[str, nn.Module]]:
    """(path, submodule) of every submodule a plan key names, matched token by token with fnmatch over
    `named_children`, as `parallelize_module` matches them ("" is the module itself)."""
    if pattern == "":
        yield "", module
        return
    token, _, rest = pattern.partition(".")
    for name, child in module.named_children():
        if fnmatch(name, token):
            for path, found in resolve(child, rest):
                yield (f"{name}.{path}" if path else name), found


def _style_dims(module: nn.Module, style: ParallelStyle) -> list[tuple[str, int]]:
    """(what, size) of the dimensions `style` shards on `module` (Colwise/Rowwise on Linear and Embedding) that the TP
    degree must divide. A vocabulary need not be divisible: an embedding's rows (RowwiseParallel) and the rows of a
    head whose output is gathered (ColwiseParallel to Replicate) may be sharded unevenly, as `torch.chunk` splits
    them (97 rows over 2 ranks: 49 and 48), since nothing after them sees the local size."""
    if isinstance(module, nn.Linear):
        if isinstance(style, ColwiseParallel):
            gathered = isinstance(first_layout(style.output_layouts), Replicate)
            return [] if gathered else [("out_features", module.out_features)]
        if isinstance(style, RowwiseParallel):
            return [("in_features", module.in_features)]
    if isinstance(module, nn.Embedding):
        if isinstance(style, ColwiseParallel):
            return [("embedding_dim", module.embedding_dim)]
    return []


def first_layout(layouts: object) -> object:
    """The first placement of a style's input or output layouts (a placement or a tuple of them)."""
    return layouts[0] if isinstance(layouts, (tuple, list)) and layouts else layouts


def _heads(module: nn.Module) -> list[tuple[str, int]]:
    """The head counts `module` declares (`HEAD_ATTRS`)."""
    return [(a, v) for a in HEAD_ATTRS if isinstance(v := getattr(module, a, None), int)
            and not isinstance(v, bool)]


def plan_errors(parts: Sequence[nn.Module], plan: Mapping[str, ParallelStyle], tp: int,
                first_part: int = 0) -> tuple[set[str], list[str]]:
    """(the plan keys some part has, what cannot be sharded): every sharded dimension and the head counts of the
    modules around a sharded projection must be divisible by `tp`."""
    found: set[str] = set()
    errors: list[str] = []
    for k, part in enumerate(parts, first_part):
        owners = dict(part.named_modules())
        for key, style in plan.items():
            if not isinstance(style, ParallelStyle):
                raise ValueError(f"tp_plan[{key!r}] must be a torch ParallelStyle (ColwiseParallel(), ...), "
                                 f"got {type(style).__name__}")
            for path, module in resolve(part, key):
                found.add(key)
                dims = _style_dims(module, style)
                checks = [(path, type(module).__name__, what, n) for what, n in dims]
                parent_path = path.rpartition(".")[0]
                parent = owners.get(parent_path) if dims else None
                if parent is not None:
                    checks += [(parent_path, type(parent).__name__, what, n) for what, n in _heads(parent)]
                errors += [f"part {k} module {where!r} ({cls}) has {what}={n}, not divisible by the TP degree {tp}"
                           for where, cls, what, n in checks if n % tp]
    return found, list(dict.fromkeys(errors))


def check_plan(parts: Sequence[nn.Module], plan: TPPlan, tp: int) -> None:
    """ValueError, before anything is sharded, when `plan` names a module no part has, or `tp` does not divide a
    dimension it shards or the heads around it (a CheckedPlan checks itself; other callables are trusted)."""
    if not isinstance(plan, Mapping):
        if isinstance(plan, CheckedPlan):
            plan.check(parts, tp)
        elif not callable(plan):
            raise ValueError(f"tp_plan must be a dict of ParallelStyles or a callable (part, tp_mesh) -> None, "
                             f"got {type(plan).__name__}")
        return
    found, errors = plan_errors(parts, plan, tp)
    missing = [key for key in plan if key not in found]
    if missing:
        raise ValueError(f"tp_plan names module(s) {missing} that no model part has (TP degree {tp}); "
                         f"the parts' modules are e.g. {_some_paths(parts)}")
    if errors:
        raise ValueError("tp_plan cannot shard the model: " + summary(errors))


def summary(errors: Sequence[str], shown: int = 3) -> str:
    """The first `shown` errors, then how many more there are."""
    more = len(errors) - shown
    return "; ".join(errors[:shown]) + (f"; ... ({more} more)" if more > 0 else "")


def _some_paths(parts: Sequence[nn.Module], limit: int = 8) -> list[str]:
    """A few module paths of the parts (for error messages)."""
    paths = [name for part in parts for name, _ in part.named_modules() if name]
    return paths[:limit]


def parallelize_part(part: nn.Module, plan: TPPlan, tp_mesh: DeviceMesh, restyle: Restyle | None = None) -> None:
    """Shard `part` in place over `tp_mesh`: a dict plan's keys that this part has (each resolved to its modules,
    no warning for the others, each module's style passed through `restyle` when given), or the callable plan.
    Every rank of the TP group holds the same whole weights, so each keeps its own slice (no communication).
    Parameters one part uses in several modules stay one parameter."""
    shared = _shared_params(part)
    if isinstance(plan, Mapping):
        concrete = {path: style if restyle is None else restyle(path, module, style)
                    for key, style in plan.items() for path, module in resolve(part, key)}
        if concrete:
            parallelize_module(part, tp_mesh, concrete, src_data_rank=None)
    else:
        plan(part, tp_mesh)
    _retie(part, shared)


def _shared_params(part: nn.Module) -> list[list[tuple[str, str]]]:
    """(module path, attribute) groups that hold one Parameter (tied weights inside a part)."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for path, module in part.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((path, attr))
    return [sorted(set(h)) for h in holders.values() if len(set(h)) > 1]


def _retie(part: nn.Module, shared: list[list[tuple[str, str]]]) -> None:
    """Make each group of `shared` hold one parameter again: the sharded one, when every module sharded it alike."""
    for group in shared:
        params = [getattr(part.get_submodule(path), attr) for path, attr in group]
        if all(p is params[0] for p in params):
            continue
        layouts = [tuple(p.placements) if isinstance(p, DTensor) else "whole" for p in params]
        if len(set(layouts)) > 1:
            desc = ", ".join(f"{path}.{attr}: {lay}" for (path, attr), lay in zip(group, layouts, strict=True))
            raise ValueError(f"a tied parameter is sharded differently by the tp_plan ({desc}); give every module "
                             "that uses it the same layout (e.g. a vocab-parallel embedding with a column-parallel "
                             "head) or untie it")
        for path, attr in group[1:]:
            setattr(part.get_submodule(path), attr, params[0])


def partial_modules(part: nn.Module) -> list[nn.Module]:
    """The modules of `part` marked `ReplicatedWithGradAllReduce` (their plain parameters' gradients are partial sums
    over TP; ask them for their parameters when needed: expert parallelism may still drop experts)."""
    return [m for m in part.modules() if getattr(m, PARTIAL_OVER_TP, False)]


def partial_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The plain (non-DTensor) parameters of `modules`, each once."""
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            if not isinstance(p, DTensor):
                seen.setdefault(id(p), p)
    return list(seen.values())


def sharded_over_tp(p: Tensor) -> bool:
    """Whether each TP rank holds a different piece of `p` (a DTensor sharded along its "tp" mesh dimension; a
    DTensor over other dimensions only, such as FSDP's "dp", is whole on every TP rank)."""
    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names
    if names is None:  # a mesh of a user's own without names: taken for the TP mesh
        return any(x.is_shard() for x in p.placements)
    return any(x.is_shard() for n, x in zip(names, p.placements, strict=True) if n == "tp")


def local_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters this rank holds (a DTensor's local shard)."""
    total = 0
    for p in module.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total
