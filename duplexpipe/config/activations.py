"""The activation-memory options of a Pipeline, torch-free: checkpointing (what is recomputed in backward) and
offloading (what waits in host memory), checked as settings (`model.stages` and `runtime.offload` apply them)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

CHECKPOINTING_MODES = ("full", "selective")
"""The string values of `PipelineConfig.activation_checkpointing`."""


def check_checkpointing(option: Any) -> None:
    """ValueError naming `option` unless it is one of `activation_checkpointing`'s values (stage indices are checked
    against the schedule later: `resolve_checkpointing`)."""
    if isinstance(option, bool) or option in CHECKPOINTING_MODES:
        return
    if isinstance(option, Mapping):
        every = option.get("every")
        if set(option) == {"every"} and isinstance(every, int) and not isinstance(every, bool) and every >= 1:
            return
        if set(option) == {"blocks"} and checkpointed_blocks(option["blocks"]) is not None:
            return
    elif isinstance(option, Collection) and not isinstance(option, str) and all(map(_is_int, option)):
        return
    modes = " or ".join(map(repr, CHECKPOINTING_MODES))
    raise ValueError(f"PipelineConfig.activation_checkpointing must be True/False, {modes}, {{'every': k}} (k >= 1), "
                     f"{{'blocks': [i, ...]}} (block indices >= 0) or a collection of stage indices; got {option!r}")


def checkpointed_blocks(value: Any) -> frozenset[int] | None:
    """The block indices of {"blocks": value}: an index >= 0 or a non-empty collection of them (None otherwise)."""
    found = (value,) if _is_int(value) else value
    if isinstance(found, Collection) and not isinstance(found, str) and found and \
            all(_is_int(b) and b >= 0 for b in found):
        return frozenset(found)
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_offload(value: object, where: str) -> None:
    """ValueError naming `where` unless `value` is a bool or a fraction 0 < f <= 1."""
    if isinstance(value, bool):
        return
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{where} must be True, False or a fraction 0 < f <= 1 of the live activations, "
                         f"got {value!r}")
