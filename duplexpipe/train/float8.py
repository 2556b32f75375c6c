"""Float8 compute in the stages: torchao's Float8Linear on each stage's eligible linears, checked before training, with
a backward that a split schedule runs as I (the input gradient, with its scaling) and W (the weight gradient, with
its own).

`PrecisionConfig.float8` names a torchao recipe ("tensorwise", "rowwise"), with options as in
"tensorwise(emulate=true)" (`Float8Options`). `convert_stages` swaps every eligible nn.Linear of a rank's stages for
torchao's Float8Linear (`convert_to_float8_training`, the recipe's `Float8LinearConfig`), keeping in high precision,
as torchtitan's float8 converter does, the linears whose dimensions are not divisible by 16, the output projection
(a module named head, lm_head or output), the MoE layers (experts, shared experts, routers: torchao has no float8
grouped GEMM for duplexpipe's experts) and the projections `moe.linear` runs (it reads their weights itself). The
weights stay the module's high-precision parameters under the same names, so checkpoints do not change.

torchao's backward (`matmul_with_hp_or_float8_args`) computes both gradients in one run; a split schedule would run it
at I and again at W, computing each GEMM twice. `SplitFloat8Linear` runs the same forward through a Function whose
backward reads its node's mark (`runtime.backward.mode`): at I it casts the output gradient and the weight for the
input gradient and forms only that GEMM, at W it casts them for the weight gradient and forms only that one, with
torchao's own cast helpers and configs, so the two halves are torchao's unsplit backward, operation for operation.
Compiled stages keep torchao's Function (a compiled region's backward is split into an I and a W graph already).

Under ZeRO-3 the converted weights are gathered in float8 (`Float8Options.fsdp_all_gather`; the weight reaches
`SplitFloat8Linear` already cast, which its backward takes as is, as torchao's does). Under tensor parallelism a dict
plan's plain column and row styles become torchao's Float8ColwiseParallel / Float8RowwiseParallel on the converted
linears where those compute torchao's single-process math (no bias, tensorwise casts: `train.float8_tp`); the
others keep the plain styles.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from duplexpipe.config.precision import RECIPES as RECIPES
from duplexpipe.config.precision import Float8Options as Float8Options
from duplexpipe.config.precision import float8_options as float8_options

if TYPE_CHECKING:
    import torch.distributed as dist

    from duplexpipe.train.float8_tp import Float8Styles

LOG = logging.getLogger("duplexpipe.float8")
TORCHAO_VERSIONS = ((0, 18), (0, 19))
"""The torchao versions float8 runs on: at least the first, below the second (its float8 backward is read here)."""
MIN_CAPABILITY = (8, 9)
"""The CUDA compute capability of FP8 matrix multiplies (Ada, Hopper and newer)."""
DIVISOR = 16
"""A linear converts only when both its dimensions are divisible by this (the FP8 GEMMs' requirement)."""
HIGH_PRECISION_NAMES = ("head", "lm_head", "output", "router")
"""A linear under a module of one of these names stays in high precision (the output projection, MoE routers)."""


def check_torchao() -> str:
    """The installed torchao's version; ValueError naming it and the range float8 needs when it is missing or out of
    that range."""
    low, high = (".".join(map(str, v)) for v in TORCHAO_VERSIONS)
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"float8 needs torchao >={low},<{high} (pip install 'duplexpipe[float8]'); torchao is not "
                         "installed") from None
    if not supported_version(version):
        raise ValueError(f"float8 needs torchao >={low},<{high}; the installed torchao is {version}")
    return version


def supported_version(version: str) -> bool:
    """Whether a torchao version string is in TORCHAO_VERSIONS' range."""
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    release = tuple(parts)
    return TORCHAO_VERSIONS[0] <= release < TORCHAO_VERSIONS[1]


def has_fp8_gemm(device: torch.device) -> bool:
    """Whether `device` runs FP8 matrix multiplies (CUDA of compute capability MIN_CAPABILITY or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def resolve_emulate(options: Float8Options, device: torch.device) -> bool:
    """Whether the GEMMs are emulated on `device`; ValueError naming the device and the recipe when FP8 hardware is
    required (emulate=False) and `device` has none."""
    hardware = has_fp8_gemm(device)
    if options.emulate is False and not hardware:
        name = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
        raise ValueError(f"float8 recipe {options.recipe!r} with emulate=False needs FP8 GEMMs (CUDA compute "
                         f"capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}); device {name} has none: set "
                         "emulate=True (or leave it unset) to emulate them")
    return bool(options.emulate) if options.emulate is not None else not hardware


def check_float8(options: Float8Options, device: torch.device) -> bool:
    """Whether float8 runs emulated on `device`; ValueError for a torchao that is missing or does not fit, or for a
    device without FP8 GEMMs when emulation is refused (what `duplexpipe train` checks before it starts processes)."""
    check_torchao()
    return resolve_emulate(options, device)


def linear_config(options: Float8Options, emulate: bool, zero_stage: int = 0) -> Any:
    """torchao's Float8LinearConfig of the recipe, emulated or not, with float8 all-gathers under ZeRO-3 (see
    `Float8Options.fsdp_all_gather`)."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(options.recipe), emulate=emulate,
                               enable_fsdp_float8_all_gather=options.all_gathers_float8(zero_stage))


def precompute_scales(modules: Iterable[nn.Module]) -> None:
    """After an optimizer step: the float8 scales of the next all-gathers of every FSDP-sharded converted weight
    under `modules` (one all-reduce of their amaxes over the data-parallel group; nothing without such weights)."""
    linears = float8_linears(modules)
    if any(getattr(m.weight, "_local_tensor", None) is not None for m in linears):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        holder = nn.ModuleList(linears)
        precompute_float8_dynamic_scale_for_fsdp(holder)


def _high_precision(module: nn.Module) -> dict[int, str]:
    """id(linear) -> why it stays in high precision, for every nn.Linear of `module` that does."""
    from duplexpipe.moe import CausalSelfAttention, Expert, GatedMLP, GatedShared, MoELayer

    kept: dict[int, str] = {}
    for owner in module.modules():
        if isinstance(owner, MoELayer):  # torchao has no float8 grouped GEMM for these experts
            kept.update((id(m), "MoE experts and routers") for m in owner.modules() if isinstance(m, nn.Linear))
        elif isinstance(owner, (CausalSelfAttention, Expert, GatedMLP, GatedShared)):  # moe.linear reads the weights
            kept.update((id(m), "MoE block projections") for m in owner.children()
                        if isinstance(m, nn.Linear) and id(m) not in kept)
    for name, linear in module.named_modules():
        if not isinstance(linear, nn.Linear) or id(linear) in kept:
            continue
        if set(name.split(".")) & set(HIGH_PRECISION_NAMES):
            kept[id(linear)] = "output projections and routers"
        elif linear.in_features % DIVISOR or linear.out_features % DIVISOR:
            kept[id(linear)] = f"dimensions not divisible by {DIVISOR}"
    return kept


def convert_stages(stage_modules: Mapping[int, nn.Module], options: Float8Options, device: torch.device, *,
                   split: bool = True, zero_stage: int = 0) -> list[str]:
    """Swap the eligible linears of every stage for torchao's Float8Linear in place (`SplitFloat8Linear` when `split`:
    eager stages; weights gathered in float8 under ZeRO-3 per `Float8Options.fsdp_all_gather`) and log once what was
    converted and what was kept; returns the converted modules' names ("stage.name"). ValueError before anything
    changes for a torchao or a device that cannot run it."""
    emulate = check_float8(options, device)
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    from duplexpipe.train.float8_linear import SplitFloat8Linear

    config = linear_config(options, emulate, zero_stage)
    converted: list[str] = []
    kept: dict[str, int] = {}
    for stage in sorted(stage_modules):
        module = stage_modules[stage]
        reasons = _high_precision(module)
        for why in reasons.values():
            kept[why] = kept.get(why, 0) + 1
        convert_to_float8_training(module, config=config, module_filter_fn=lambda m, _n, r=reasons: id(m) not in r)
        for name, child in module.named_modules():
            if isinstance(child, Float8Linear):
                if split:
                    child.__class__ = SplitFloat8Linear
                converted.append(f"{stage}.{name}")
    how = "emulated: no FP8 GEMMs" if emulate else "FP8 GEMMs"
    left = ", ".join(f"{n} ({why})" for why, n in sorted(kept.items())) or "none"
    level = logging.WARNING if emulate and options.emulate is None else logging.INFO  # unasked: no speed-up
    gather = "" if zero_stage != 3 else "; ZeRO-3 all-gathers them in " + (
        "float8" if config.enable_fsdp_float8_all_gather else "high precision")
    LOG.log(level, "float8 %s (%s on %s): %d linears converted; kept in high precision: %s%s", options.recipe, how,
            device.type, len(converted), left, gather)
    return converted


def float8_tp_styles(plan: object, tp_size: int, tp_group: dist.ProcessGroup | None) -> Float8Styles | None:
    """A `train.float8_tp.Float8Styles` for a dict tp_plan over the TP group `tp_group` of `tp_size` > 1 ranks
    (torchao's float8 styles where they compute torchao's math); None for a callable plan (its own styles) or
    without tensor parallelism."""
    if tp_size <= 1 or not isinstance(plan, Mapping):
        return None
    from torch.distributed import get_backend

    from duplexpipe.train.float8_tp import Float8Styles

    return Float8Styles(float8_collectives=get_backend(tp_group) != "gloo")


def float8_linears(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The torchao Float8Linear modules under `modules` (none without torchao)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [m for module in modules for m in module.modules() if isinstance(m, Float8Linear)]
