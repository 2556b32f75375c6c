"""Tensor parallelism in the planner's model: a TP rank's share of each part (compute, parameters, activations,
messages) and the TP collectives priced from their bytes on the TP link.

A TP rank runs every operation of its stage on 1/T of the weights: the part of each pass that grows with the
microbatch is divided by T, the fixed part (per-operation dispatch) is not. The collectives are counted from the
plan itself when the part was profiled with one (`profile.TPFacts`): one per row-parallel module in the forward
(Megatron: 2 per transformer layer, after attention and after the MLP) and one per column-parallel module with a
replicated input in the backward (Megatron's fused QKV: 2 per layer; DTensor's separate q, k, v: 4), each of the
whole activation. A ring all-reduce of B bytes over T ranks sends 2(T-1)/T x B in 2(T-1) messages; with sequence
parallelism each becomes a reduce-scatter and an all-gather of the same bytes, so it is priced alike. They block
the stage (the next operation needs their result), so their time is added to F (forward) and to I and B (backward).
"""

from __future__ import annotations

from dataclasses import replace

from duplexpipe.errors import PlanError
from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.profile import PartProfile, Profile, TPFacts

DEFAULT_TP_BANDWIDTH = 300e9
"""Bytes per second each way between the ranks of a TP group when none is given: NVLink 3 (A100 SXM, 600 GB/s
bidirectional per GPU), the slower of the two common intra-node NVLink generations (H100's NVLink 4: 450 GB/s each
way). TP groups are the innermost mesh dimension, inside one node (DESIGN, "Tensor parallelism")."""


def all_reduce_time(nbytes: float, tp: int, link: Link, collectives: int = 1) -> float:
    """Seconds for `collectives` ring all-reduces of `nbytes` bytes in all over `tp` ranks (0 when tp = 1)."""
    if tp <= 1 or collectives <= 0:
        return 0.0
    return link.time(2 * (tp - 1) / tp * nbytes, 2 * (tp - 1) * collectives)


def collective_times(facts: TPFacts, tp: int, link: Link) -> tuple[float, float]:
    """(forward, backward) seconds a TP rank spends in the part's collectives per microbatch."""
    return (all_reduce_time(facts.forward_bytes, tp, link, facts.forward_collectives),
            all_reduce_time(facts.backward_bytes, tp, link, facts.backward_collectives))


def tp_refusal(profile: Profile, tp: int) -> str | None:
    """Why `profile` cannot be planned at TP degree `tp` (None: it can)."""
    if tp == 1:
        return None
    if profile.tp_degrees is None or any(p.tp is None for p in profile.parts):
        return (f"tp={tp}: the profile has no tensor-parallel facts; profile the model with its TP plan "
                "(duplexpipe profile on a task with a tp_plan, or profile_parts(tp_plan=...))")
    if tp not in profile.tp_degrees:
        allowed = ", ".join(map(str, profile.tp_degrees)) or "none"
        return f"the TP plan cannot shard the model at tp={tp} (degrees it can: {allowed})"
    return None


def _divided(time: float, fixed: float | None, tp: int) -> float:
    """A pass's time on one TP rank: its fixed part whole, the rest divided by `tp`."""
    base = fixed or 0.0
    return base + (time - base) / tp


def local_part(part: PartProfile, tp: int, link: Link, sequence_parallel: bool) -> PartProfile:
    """One TP rank's share of `part` (profiled with a plan): divided compute plus its collectives, parameters
    divided except the replicated ones, activations and stage messages divided under sequence parallelism."""
    facts = part.tp
    if tp == 1 or facts is None:
        return part
    forward, backward = collective_times(facts, tp, link)
    fused = part.backward_fused_s
    if fused is not None:
        fused = _divided(fused, part.backward_fused_fixed_s, tp) + backward
    params = facts.replicated_param_bytes + (part.param_bytes - facts.replicated_param_bytes) / tp
    shard = tp if sequence_parallel else 1
    return replace(
        part, forward_s=_divided(part.forward_s, part.forward_fixed_s, tp) + forward,
        backward_input_s=_divided(part.backward_input_s, part.backward_input_fixed_s, tp) + backward,
        backward_weight_s=_divided(part.backward_weight_s, part.backward_weight_fixed_s, tp),
        backward_fused_s=fused, param_bytes=round(params), activation_bytes=round(part.activation_bytes / shard),
        output_bytes=round(part.output_bytes / shard), output_grad_bytes=round(part.output_grad_bytes / shard),
        selective_activation_bytes=None if part.selective_activation_bytes is None else
        round(part.selective_activation_bytes / shard),
        selective_held_bytes=None if part.selective_held_bytes is None else round(part.selective_held_bytes / shard),
        selective_recompute_s=None if part.selective_recompute_s is None else part.selective_recompute_s / tp)


def local_profile(profile: Profile, tp: int, link: Link, sequence_parallel: bool) -> Profile:
    """`profile` (at the candidate's microbatch) as one TP rank of degree `tp` runs it (`local_part` per part).

    Raises PlanError when the profile cannot be planned at `tp` (`tp_refusal`). Without sequence parallelism the
    activations are kept whole: the profile cannot tell the saved tensors inside the TP regions (sharded) from the
    norms' and the residual stream's (replicated), so the byte model is an upper bound there (Megatron counts 24 of
    34 bytes per token and hidden unit of a layer's saved activations as divided).
    """
    why = tp_refusal(profile, tp)
    if why:
        raise PlanError(why)
    if tp == 1:
        return profile
    return replace(profile, parts=tuple(local_part(p, tp, link, sequence_parallel) for p in profile.parts))
