"""The planner's memory levers on a plan: activation checkpointing applied to the part profiles (`checkpointed`), and
what a plan says about the levers it pulled (`policy_note`, `offload_note`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from duplexpipe.errors import ProfileError
from duplexpipe.planner.candidates import CHECKPOINTING, checkpointing_policy
from duplexpipe.planner.host_offload import offload_label
from duplexpipe.planner.profile import PartProfile
from duplexpipe.sizes import format_bytes

if TYPE_CHECKING:
    from duplexpipe.planner.plan import PlanConfig, PlanRow


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


def policy_note(rows: Sequence[PlanRow], best: PlanRow, config: PlanConfig) -> str:
    """Why `best` runs its checkpointing policy ("" for none), beside the same plan under the other policies:
    "; checkpointing selective (off needs 1 GiB, full not needed)". A lighter policy without a row was not allowed
    (`PlanConfig.checkpointing`) or, selective, not measured by the profile; a heavier one was not needed (tried
    only where the one below it is over the cap)."""
    if best.checkpointing == "off":
        return ""
    key = (best.schedule, best.microbatches, best.zero, best.window, best.mesh, best.offload)
    same = {r.checkpointing: r for r in rows
            if (r.schedule, r.microbatches, r.zero, r.window, r.mesh, r.offload) == key}
    allowed = {checkpointing_policy(p) for p in config.checkpointing}
    notes = []
    for policy in CHECKPOINTING:
        row = same.get(policy)
        if policy == best.checkpointing:
            continue
        if row is None:
            heavier = CHECKPOINTING.index(policy) > CHECKPOINTING.index(best.checkpointing)
            notes.append(f"{policy} not needed" if heavier else f"{policy} not allowed" if policy not in allowed
                         else f"{policy} not measured by the profile")
        elif row.over_cap:
            notes.append(f"{policy} needs {format_bytes(row.peak_bytes)}")
        elif row.feasible:
            notes.append(f"{policy} fits at {format_bytes(row.peak_bytes)}, {row.step_s / best.step_s - 1:+.0%} step")
        else:
            notes.append(f"{policy}: {row.rejected}")
    return f"; checkpointing {best.checkpointing} ({', '.join(notes)})"


def offload_note(rows: Sequence[PlanRow], best: PlanRow, config: PlanConfig) -> str:
    """What `best`'s offload costs, or, when memory decided and no host link is known, that offload was not
    planned ("" otherwise)."""
    if best.offload is not False:
        return f"; offload {offload_label(best.offload)} (copies add {best.offload_s * 1e3:.3g} ms beyond the compute)"
    if config.host_link is None and any(r.over_cap and r.step_s <= best.step_s for r in rows):
        return "; activation offload not planned: no host-copy bandwidth known"
    return ""
