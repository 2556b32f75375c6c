"""The planner's memory levers on the part profiles: activation checkpointing applied to them (`checkpointed`) and its
labels (what a plan says about the levers it pulled is the plan's: `plan.policy_note`, `plan.offload_note`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from duplexpipe.errors import ProfileError
from duplexpipe.planner.profile import PartProfile


def checkpointed(groups: Sequence[PartProfile], policy: str = "full") -> tuple[tuple[PartProfile, ...],
                                                                             tuple[int, ...]]:
    """`groups` with every part checkpointed under `policy` ("full" or "selective"), and per part what its recompute
    holds beyond what it saved.

    Full: a part saves its inputs only (the previous part's output; the first part's own output stands in for the
    model's input) and runs its forward once more in its input-gradient backward (I, and a fused B). Selective: a
    part saves what the profile measured under the runtime's selective policy (`PartProfile.
    selective_activation_bytes`), holds what it measured once the recompute ran (`selective_held_bytes`: with the
    policy's cache, which may keep outputs the backward never takes) and its I (and a fused B) takes the measured
    recompute longer (`selective_recompute_s`); ProfileError where a part has no such figures.
    """
    out, extra = [], []
    for g, part in enumerate(groups):
        if policy == "selective":
            if part.selective_activation_bytes is None or part.selective_recompute_s is None:
                raise ProfileError(f"part {g} of the profile has no selective-checkpointing figures; profile it "
                                   "again to plan selective checkpointing")
            saved, again = min(part.activation_bytes, part.selective_activation_bytes), part.selective_recompute_s
            held = part.selective_held_bytes if part.selective_held_bytes is not None else part.activation_bytes
        else:
            saved, again = min(part.activation_bytes, (groups[g - 1] if g else part).output_bytes), part.forward_s
            held = part.activation_bytes
        fused = None if part.backward_fused_s is None else part.backward_fused_s + again
        out.append(replace(part, activation_bytes=saved, backward_input_s=part.backward_input_s + again,
                           backward_fused_s=fused))
        extra.append(max(0, held - saved))
    return tuple(out), tuple(extra)


def checkpointed_label(policy: str) -> str:
    """How a plan's label says its checkpointing: "", ", checkpointed", ", selectively checkpointed"."""
    return {"off": "", "full": ", checkpointed"}.get(policy, f", {policy}ly checkpointed")
