"""Global state names: what a model part's parameters and buffers are called in the whole model (checkpoint keys).

A checkpoint keyed by these names loads into any schedule, pipeline size, partition, data-parallel size or ZeRO
stage. The names come from the part's own state_dict keys, mapped by hooks:

- A module may define `global_state_key(self, key: str) -> str`: it maps a key relative to that module (as its
  own `state_dict()` names it) to the key the same tensor has relative to the same module in the whole model.
  Hooks apply innermost first: a hook sees the keys below it already mapped by the hooks further down. Example:
  an expert-parallel MoE layer holding experts 8..11 of 16 as `experts.0..3` maps `experts.1.w1` to
  `experts.9.w1` (the global expert index); the Hugging Face part around it maps `layers.3.mlp.experts.9.w1`
  to `model.layers.3.mlp.experts.9.w1`.
- A part whose own module defines the hook (e.g. `CausalLMPart`: the transformers names) names the whole
  model; so does a part made by `split_model` / `Pipeline.from_layers` (children `embedding`, `layer<i>` with
  the global block index, `head`).
- Any other part k is prefixed `part<k>.`: its names then depend on the partition (not on the schedule,
  pipeline size, data-parallel size or ZeRO stage).
- A module compiled with `torch.compile(module)` is named as the module itself: the wrapper's `_orig_mod.` is
  left out, so compiled and eager layouts load each other's checkpoints.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

GLOBAL_KEY_HOOK = "global_state_key"
"""The method a module defines to map its local state keys to global ones (see the module docstring)."""
_SPLIT_CHILD = re.compile(r"^(embedding|head|layer\d+)$")
COMPILED_WRAPPER = "_orig_mod"
"""The child torch.compile's module wrapper holds the module in (left out of global names)."""


def uncompiled(module: nn.Module) -> nn.Module:
    """The module a torch.compile wrapper holds (or `module` itself)."""
    inner = module._modules.get(COMPILED_WRAPPER)
    return inner if inner is not None and type(module).__name__ == "OptimizedModule" else module


def split_style(part: nn.Module) -> bool:
    """True for a part made by `split_model` / `build_parts`: an nn.Sequential whose children are named
    `embedding`, `layer<i>` (global block index) and `head`, so its keys are already global."""
    part = uncompiled(part)
    names = [name for name, _ in part.named_children()]
    return isinstance(part, nn.Sequential) and bool(names) and all(_SPLIT_CHILD.match(n) for n in names)


def names_whole_model(part: nn.Module) -> bool:
    """Whether the part's mapped keys are names in the whole model (else they get a `part<k>.` prefix)."""
    return callable(getattr(uncompiled(part), GLOBAL_KEY_HOOK, None)) or split_style(part)


def mapped_key(root: nn.Module, key: str) -> str:
    """`key` (relative to `root`) with every hook on its path applied, innermost first (the root's last)."""
    segments = key.split(".")
    owners: list[tuple[int, nn.Module]] = [(0, root)]
    module = root
    for depth, name in enumerate(segments[:-1], start=1):
        child = module._modules.get(name)
        if child is None:
            break
        owners.append((depth, child))
        module = child
    for depth, owner in reversed(owners):
        if uncompiled(owner) is not owner:
            continue  # a compiled wrapper forwards attributes to the module it holds, whose hook applies below
        hook = getattr(owner, GLOBAL_KEY_HOOK, None)
        if callable(hook):
            tail = hook(".".join(segments[depth:]))
            if not isinstance(tail, str) or not tail:
                raise ValueError(f"{type(owner).__name__}.{GLOBAL_KEY_HOOK}({'.'.join(segments[depth:])!r}) "
                                 f"returned {tail!r}, expected a non-empty key")
            segments = segments[:depth] + tail.split(".")
    return ".".join(s for s in segments if s != COMPILED_WRAPPER)


def part_state_keys(part: nn.Module, index: int, keys: Iterable[str] | None = None) -> dict[str, str]:
    """{local state key: global key} for model part `index` (its state_dict keys, or `keys`).

    Raises ValueError when two local keys map to one global key.
    """
    local = list(part.state_dict(keep_vars=True)) if keys is None else list(keys)
    prefix = "" if names_whole_model(part) else f"part{index}."
    out = {key: prefix + mapped_key(part, key) for key in local}
    seen: dict[str, str] = {}
    for key, name in out.items():
        if name in seen:
            raise ValueError(f"model part {index}: state keys {seen[name]!r} and {key!r} both map to {name!r}; "
                             f"check the {GLOBAL_KEY_HOOK} hooks")
        seen[name] = key
    return out
