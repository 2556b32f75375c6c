"""Stage modules: build only this rank's stages (from parts, meta parts or a factory), with checkpointing."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import re
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

from duplexpipe.comm.local_tensors import local_of
from duplexpipe.config.activations import check_checkpointing, checkpointed_blocks
from duplexpipe.model.split import check_parts_fit
from duplexpipe.model.state_names import split_style
from duplexpipe.moe.balance import moe_layers
from duplexpipe.runtime.backward.checkpoint import ContextFn, checkpoint
from duplexpipe.runtime.structure import WHOLE_MESSAGE
from duplexpipe.schedules.ir import Schedule

BLOCKS_HOOK = "compile_blocks"
"""A part may define `compile_blocks(self) -> Iterable[nn.Module]`: its blocks (`part_blocks`)."""


class CheckpointedStage(nn.Module):
    """Runs `module` under activation checkpointing (`runtime.backward.checkpoint`): activations inside it are
    recomputed in backward, once per microbatch; `context_fn` a policy's contexts (e.g. `selective_context`)."""

    def __init__(self, module: nn.Module, context_fn: ContextFn = noop_context_fn) -> None:
        super().__init__()
        self.module = module
        self.context_fn = context_fn
        setattr(self, WHOLE_MESSAGE, getattr(module, WHOLE_MESSAGE, False))  # called as the module is

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.module, *args, context_fn=self.context_fn, **kwargs)


CHECKPOINTED_BLOCK = "_duplexpipe_checkpointed_block"
"""Set (True) on the class `checkpoint_block` gives a block."""
SELECTIVE_SAVE = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_dot_product_flash_attention",
                  "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_efficient_attention",
                  "aten._scaled_dot_product_cudnn_attention",
                  "aten._scaled_dot_product_fused_attention_overrideable",
                  "_c10d_functional.reduce_scatter_tensor")
"""The operators whose outputs selective checkpointing saves (as torchtitan's op policy: the matmuls, attention and
tensor parallelism's reduce-scatter); every other operator of the region is recomputed."""


def _save_list() -> frozenset[Any]:
    """SELECTIVE_SAVE's operators (the default overloads) that this torch has."""
    found = []
    for name in SELECTIVE_SAVE:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, "default"):
            found.append(packet.default)
    return frozenset(found)


def _save_matmuls(saved: frozenset[Any], on_save: Callable[[Any], None] | None) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func not in saved:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if on_save is not None and not ctx.is_recompute:
            on_save(getattr(ctx, "op_output", None))
        return CheckpointPolicy.MUST_SAVE
    return policy


def selective_context(on_save: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
    """The contexts of selective checkpointing (a `context_fn`): save the outputs of `SELECTIVE_SAVE`'s operators,
    recompute the cheap ones, on torch's `create_selective_checkpoint_contexts`. `on_save`: called in the forward
    with each saved operator's output (what the policy keeps; the profiler counts its bytes)."""
    return create_selective_checkpoint_contexts(_save_matmuls(_save_list(), on_save))


def checkpoint_block(block: nn.Module, context_fn: ContextFn = noop_context_fn) -> nn.Module:
    """Run `block` under activation checkpointing from now on, in place: its class becomes a subclass whose call
    checkpoints (as torch's `fully_shard` swaps a module's class), so its module path, state dict names and a later
    `Module.compile` (inside the checkpoint) stay as they are. A block already checkpointed is left as it is."""
    base = type(block)
    if getattr(base, CHECKPOINTED_BLOCK, False):
        return block

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(base.__call__, self, *args, context_fn=context_fn, **kwargs)

    block.__class__ = type(f"Checkpointed{base.__name__}", (base,), {"__call__": call, CHECKPOINTED_BLOCK: True})
    return block


CHAINED_PARTS = "_duplexpipe_chained_parts"
"""Set (True) on a module made of several model parts run one after another (`train.part_chain.PartChain`), whose
`parts` ModuleList holds them: what applies to one model part (a tensor-parallel plan) applies to each."""


def model_parts(module: nn.Module) -> list[nn.Module]:
    """The model parts a stage module runs: the parts of a chain (`CHAINED_PARTS`), else the module itself (without
    its activation-checkpointing wrapper)."""
    inner = inner_module(module)
    return list(inner.parts) if getattr(inner, CHAINED_PARTS, False) else [inner]  # type: ignore[arg-type]


def inner_module(module: nn.Module) -> nn.Module:
    """The user's module behind a CheckpointedStage wrapper (or `module` itself)."""
    return module.module if isinstance(module, CheckpointedStage) else module


def part_blocks(part: nn.Module) -> list[nn.Module]:
    """A part's blocks, as torchtitan splits a model: those it names itself (`BLOCKS_HOOK`, e.g. a Hugging Face
    part's decoder layers), else the `layer<i>` children of a `from_layers` part, else none (the part is one
    block). What `PipelineConfig.compile` compiles and `{"every": k}` checkpoints."""
    hook = getattr(part, BLOCKS_HOOK, None)
    if callable(hook):
        return list(hook())
    if split_style(part):
        return [child for name, child in part.named_children() if name.startswith("layer")]
    return []


def block_index(part: nn.Module, block: nn.Module, position: int) -> int:
    """The index of `block` in the whole model: the number ending its name in `part` (`layer3`, `layers.3`), else
    its `position` among the part's blocks."""
    for name, module in part.named_modules():
        if module is block:
            found = re.search(r"(\d+)$", name)
            return int(found.group(1)) if found else position
    return position


@dataclass(frozen=True)
class Checkpointing(Collection[int]):
    """What `PipelineConfig.activation_checkpointing` asks of the stages: which stages (a collection of stage
    indices), with which policy ("full": recompute everything; "selective": save the matmuls' outputs), and
    whether whole stages or every k-th block (`every`)."""

    stages: frozenset[int] = frozenset()
    policy: str = "full"
    every: int | None = None
    """Checkpoint the blocks (`part_blocks`) whose index in the whole model is k-1, 2k-1, ... (as torchtitan's
    every-k option), each its own region; a part without blocks is one block, numbered by its part index. None:
    each stage is one region (or `blocks`)."""
    blocks: frozenset[int] | None = None
    """Checkpoint the blocks with these indices in the whole model, each its own region (numbered as for
    `every`); None: as `every` says."""

    def __contains__(self, stage: object) -> bool:
        return stage in self.stages

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.stages))

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def context_fn(self) -> ContextFn:
        """The policy's contexts."""
        return selective_context if self.policy == "selective" else noop_context_fn

    def apply(self, stage: int, module: nn.Module, part: int) -> nn.Module:
        """Stage `stage`'s module (model part `part`) checkpointed as asked (`module` itself when not)."""
        if stage not in self.stages:
            return module
        if self.every is None and self.blocks is None:
            return CheckpointedStage(module, self.context_fn)
        blocks = part_blocks(module)
        if not blocks:
            return CheckpointedStage(module, self.context_fn) if self.picks(part) else module
        for position, block in enumerate(blocks):
            if self.picks(block_index(module, block, position)):
                checkpoint_block(block, self.context_fn)
        return module

    def picks(self, block: int) -> bool:
        """Whether block `block` of the whole model (by `every` or `blocks`) is checkpointed on its own."""
        if self.blocks is not None:
            return block in self.blocks
        return self.every is not None and block % self.every == self.every - 1


CheckpointingOption = bool | str | Mapping[str, Any] | Collection[int]
"""`PipelineConfig.activation_checkpointing`'s values."""


def resolve_checkpointing(option: CheckpointingOption, schedule: Schedule) -> Checkpointing:
    """What to checkpoint: every stage for True, "full", "selective", {"every": k} or {"blocks": [...]}; none for
    False; else the given stages (whole)."""
    check_checkpointing(option)
    every = option.get("every") if isinstance(option, Mapping) else None
    blocks = checkpointed_blocks(option["blocks"]) if isinstance(option, Mapping) and "blocks" in option else None
    if option is False:
        return Checkpointing()
    if option is True or isinstance(option, (str, Mapping)):
        policy = option if isinstance(option, str) else "full"
        return Checkpointing(frozenset(range(schedule.num_stages)), policy, every, blocks)
    stages = frozenset(cast(Collection[int], option))
    bad = sorted(s for s in stages if not 0 <= s < schedule.num_stages)
    if bad:
        raise ValueError(
            f"activation_checkpointing names stages {bad}, but schedule {schedule.name!r} "
            f"has stages 0..{schedule.num_stages - 1}"
        )
    return Checkpointing(stages)


PartFactory = Callable[[int], nn.Module]
"""part_factory(k) -> model part k; called only for the parts this rank holds."""
PartInit = Callable[[nn.Module, int], None]
"""init(part, k) fills the freshly materialised (uninitialised) model part k in place."""
PartSource = Sequence[nn.Module] | PartFactory
"""The model parts themselves (possibly on the meta device), or a factory building part k."""


def part_seed(seed: int, part: int) -> int:
    """The torch seed of model part `part` under run seed `seed`: seed * 1_000_003 + part."""
    return seed * 1_000_003 + part


@contextlib.contextmanager
def seeded_part(seed: int, part: int) -> Iterator[None]:
    """Run the block with torch's RNG seeded for model part `part` (`part_seed`), restoring the
    RNG state afterwards (CPU and CUDA), so part k gets the same weights on every rank and in a
    model built whole part by part."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(part_seed(seed, part))
        yield


def reset_parameters(part: nn.Module) -> None:
    """Initialise a part the way its layers' constructors do: `reset_parameters()` on every
    submodule that has one. Raises ValueError naming parameters no such submodule owns."""
    covered: set[int] = set()
    for module in part.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
            covered.update(id(p) for p in module.parameters())
    missing = [n for n, p in part.named_parameters() if id(p) not in covered]
    if missing:
        shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise ValueError(f"no submodule with reset_parameters() owns {shown}; pass an init that "
                         "initialises them")


def seeded_init(seed: int, init: Callable[[nn.Module], None] = reset_parameters) -> PartInit:
    """A PartInit running `init(part)` under `seeded_part(seed, k)`: part k's weights depend only
    on (seed, k), whichever rank builds it."""
    def run(part: nn.Module, k: int) -> None:
        with seeded_part(seed, k):
            init(part)
    return run


def as_factory(source: PartSource) -> PartFactory | None:
    """The factory when `source` is one; None when it is a sequence of parts."""
    if callable(source) and not isinstance(source, nn.Module):
        return cast(PartFactory, source)
    return None


def on_meta(module: nn.Module) -> bool:
    """True when any parameter or buffer of `module` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def copy_module(module: nn.Module) -> nn.Module:
    """A deep copy of `module` (without torch's pytree deprecation noise when copying traced graphs)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        return copy.deepcopy(module)


def materialize_part(
    source: PartSource, k: int, device: torch.device | str | None, init: PartInit | None
) -> nn.Module:
    """Model part k as a module of its own on `device`.

    From a factory: `factory(k)`. From a list: a deep copy of `parts[k]`; a part on the meta
    device is allocated with `to_empty` (no values copied) and filled by `init(part, k)`.
    """
    factory = as_factory(source)
    if factory is not None:
        module = factory(k)
        if not isinstance(module, nn.Module):
            raise TypeError(f"part_factory({k}) returned a {type(module).__name__}, not an nn.Module")
        if on_meta(module):
            if init is None:
                raise ValueError(f"part_factory({k}) built the part on the meta device; pass init= to fill it")
            module = module.to_empty(device=device or "cpu")
            init(module, k)
        elif device is not None:
            module = module.to(device)
        return module
    part = cast(Sequence[nn.Module], source)[k]
    if not on_meta(part):
        module = copy_module(part)
        return module.to(device) if device is not None else module
    if init is None:
        raise ValueError(f"model part {k} is on the meta device; pass init= (e.g. seeded_init(seed)) "
                         "to fill this rank's parts")
    module = copy_module(part).to_empty(device=device or "cpu")
    init(module, k)
    return module


def build_stage_modules(
    schedule: Schedule,
    rank: int,
    parts: PartSource,
    *,
    checkpoint_stages: Collection[int] = (),
    device: torch.device | str | None = None,
    init: PartInit | None = None,
) -> dict[int, nn.Module]:
    """This rank's stage modules: stage s runs model part `schedule.stages[s].group`.

    Only the parts this rank holds are built (`materialize_part`): a factory is called for
    them alone and meta parts are allocated for them alone. A second stage of the same part on
    this rank gets a deep copy. Copies of one part on different ranks (DualPipe's mirrors) start
    identical when every rank builds part k the same way (same seed or state_dict; for factories
    and inits, seed per part: `seeded_part`, `seeded_init`).
    """
    if as_factory(parts) is None:
        check_parts_fit(len(cast(Sequence[nn.Module], parts)), schedule)
    if not 0 <= rank < schedule.num_ranks:
        raise ValueError(f"rank {rank} is outside 0..{schedule.num_ranks - 1} for schedule {schedule.name!r}")
    built: dict[int, nn.Module] = {}
    modules: dict[int, nn.Module] = {}
    for stage in schedule.stages_of_rank(rank):
        group = schedule.stages[stage].group
        if group in built:
            module = copy_module(built[group])
        else:
            module = built[group] = materialize_part(parts, group, device, init)
        if isinstance(checkpoint_stages, Checkpointing):
            modules[stage] = checkpoint_stages.apply(stage, module, group)
        else:
            modules[stage] = CheckpointedStage(module) if stage in checkpoint_stages else module
    return modules


def fingerprint(module: nn.Module) -> str:
    """A hash of the module's parameters and buffers (names, shapes, dtypes and values; of a DTensor, its local
    shard) that every replica holds alike: experts already spread over an expert-parallel group (each rank its own)
    are left out."""
    digest = hashlib.sha256()
    own = {id(t) for layer in moe_layers(inner_module(module)) if layer.ep.size > 1
           for t in layer.experts.state_dict(keep_vars=True).values()}
    for name, tensor in inner_module(module).state_dict(keep_vars=True).items():
        if id(tensor) in own:
            continue
        t = local_of(tensor).detach().to("cpu").contiguous()  # a DTensor: this rank's shard
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()[:20]


def find_mismatched_copies(
    schedule: Schedule, fingerprints: Sequence[Mapping[int, str]]
) -> list[tuple[int, list[tuple[int, str]]]]:
    """Groups whose copies differ: (group, [(stage, fingerprint) ...]).

    `fingerprints` holds one {stage: fingerprint} map per reporting rank (several maps may name
    the same stage, e.g. data-parallel replicas).
    """
    seen: dict[int, list[tuple[int, str]]] = {}
    for entry in fingerprints:
        for stage, fp in sorted(entry.items()):
            seen.setdefault(schedule.stages[stage].group, []).append((stage, fp))
    return [(g, copies) for g, copies in sorted(seen.items()) if len({fp for _, fp in copies}) > 1]
