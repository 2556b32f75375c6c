"""Profile: measured per-part costs and bytes of a model, as JSON, usable without torch."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from duplexpipe.errors import ProfileError
from duplexpipe.files import read_capped_text
from duplexpipe.planner.partition import balanced_split

PROFILE_FORMAT = "duplexpipe-profile"
PROFILE_VERSION = 1
MAX_PROFILE_FILE_BYTES = 64 * 2**20
"""Largest profile file read (64 MiB; a profile of thousands of parts is a few MB)."""

TP_DEGREES_CHECKED = 64
"""The largest tensor-parallel degree a profile records as possible (`Profile.tp_degrees`)."""
MAX_PART_SECONDS = 86_400
"""Longest time a profile may give one action of one part on one microbatch (a day): the planner sums these over
microbatches, stages and candidates, and a larger figure is a crafted or broken profile."""
MAX_PART_BYTES = 2**60
"""Most bytes a profile may give one part (1 EiB), for the same reason."""


@dataclass(frozen=True)
class TPFacts:
    """What a tensor-parallel plan does to one part, measured on the whole part at the profiled microbatch: the
    collectives a TP rank issues per microbatch and the parameters the plan leaves whole (see `tp_comm`)."""

    forward_collectives: int
    """Collectives of one forward: one per row-parallel module (an all-reduce of its output; with sequence
    parallelism a reduce-scatter after it and an all-gather before the region: the same bytes), one per
    column-parallel module whose output is gathered."""
    forward_bytes: int
    """Bytes those collectives reduce or gather, summed: each the whole activation (what one rank holds before
    the reduction)."""
    backward_collectives: int
    """Collectives of one backward: one per column-parallel module whose input is replicated (the all-reduce of
    its input gradient; Megatron's fused QKV makes one per attention, DTensor's separate q, k, v three)."""
    backward_bytes: int
    """Bytes of those input gradients, summed."""
    replicated_param_bytes: int
    """Parameter bytes the plan leaves whole on every TP rank (norms, a row-parallel layer's bias, modules it does
    not name); the rest is divided over the TP ranks."""

    def scaled(self, factor: float) -> TPFacts:
        """For a microbatch `factor` times as large: activation bytes times `factor`, counts and parameters kept."""
        return replace(self, forward_bytes=round(self.forward_bytes * factor),
                       backward_bytes=round(self.backward_bytes * factor))

    def to_dict(self) -> dict[str, int]:
        """The JSON form."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def total(facts: list[TPFacts | None]) -> TPFacts | None:
        """The facts of several parts run as one (sums), or None when any part has none."""
        known = [f for f in facts if f is not None]
        if len(known) < len(facts) or not known:
            return None
        return TPFacts(*(sum(getattr(f, name.name) for f in known) for name in fields(TPFacts)))

    @staticmethod
    def from_dict(data: Any, where: str) -> TPFacts:
        """Inverse of `to_dict`; ProfileError names the bad field."""
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: expected an object, got {type(data).__name__}")
        values = []
        for f in fields(TPFacts):
            value = data.get(f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ProfileError(f"{where}: field {f.name!r} must be an integer >= 0, got {value!r}")
            values.append(value)
        return TPFacts(*values)


@dataclass(frozen=True)
class PartProfile:
    """One model part, measured on one microbatch of `Profile.microbatch_size` samples."""

    forward_s: float
    """Seconds of its forward."""
    backward_input_s: float
    """Seconds of its input-gradient backward (I)."""
    backward_weight_s: float
    """Seconds of its weight-gradient backward (W); a full backward B costs I + W."""
    activation_bytes: int
    """Bytes its forward saves for backward (held from F until W), parameters excluded."""
    param_bytes: int
    """Bytes of its parameters."""
    output_bytes: int
    """Bytes of the message it sends forward (every tensor of its output)."""
    output_grad_bytes: int
    """Bytes of the gradient message it receives back (its output tensors that take gradients)."""
    forward_fixed_s: float | None = None
    """The part of `forward_s` that does not grow with the microbatch (per-operation dispatch), from
    timings at two microbatch sizes; None: unknown, times scale linearly with the microbatch."""
    backward_input_fixed_s: float | None = None
    """The same for `backward_input_s`."""
    backward_weight_fixed_s: float | None = None
    """The same for `backward_weight_s`."""
    backward_fused_s: float | None = None
    """Seconds of a full backward B in one pass, as the runtime runs B (measured: it is cheaper than
    I + W, which traverse the graph twice); None: not measured, B costs I + W."""
    backward_fused_fixed_s: float | None = None
    """The fixed part of `backward_fused_s` (None: none known)."""
    tp: TPFacts | None = None
    """What the tensor-parallel plan it was profiled with does to it (None: profiled without a plan)."""
    selective_activation_bytes: int | None = None
    """Bytes its forward keeps for backward when it runs under selective checkpointing (the runtime's policy,
    `model.stages.selective_context`: the matmuls' and attention's outputs saved, the rest recomputed), measured as
    `activation_bytes` is; None: not measured (the planner then never plans selective checkpointing)."""
    selective_held_bytes: int | None = None
    """The most it holds once its backward's recompute ran under selective checkpointing (what the backward needs,
    what the policy's cache still keeps: outputs it saved that the backward never takes, and what the forward saved
    outside the recompute), measured; held from its I or B to the end of its backward. None: not measured (the
    planner then takes `activation_bytes`)."""
    selective_recompute_s: float | None = None
    """The seconds its backward takes longer under selective checkpointing: the recompute of the cheap operators
    (measured as I + W over the plain I and W, clamped at 0; the planner adds it to I, where the runtime recomputes;
    None: not measured)."""

    @property
    def backward_s(self) -> float:
        """I + W: a full backward."""
        return self.backward_input_s + self.backward_weight_s

    @property
    def fixed(self) -> tuple[float, float, float] | None:
        """(F, I, W) fixed parts, or None when the profile has no affine fit."""
        values = (self.forward_fixed_s, self.backward_input_fixed_s, self.backward_weight_fixed_s)
        return None if any(v is None for v in values) else (float(values[0] or 0.0), float(values[1] or 0.0),
                                                             float(values[2] or 0.0))

    def scaled(self, factor: float) -> PartProfile:
        """For a microbatch `factor` times as large: bytes times `factor`, params kept; each time is
        fixed + (time - fixed) x factor (affine in the microbatch), or time x factor without a fit."""
        c = self.fixed or (0.0, 0.0, 0.0)
        fused = self.backward_fused_s
        if fused is not None:
            base = self.backward_fused_fixed_s or 0.0
            fused = base + (fused - base) * factor
        return replace(self, forward_s=c[0] + (self.forward_s - c[0]) * factor,
                       backward_input_s=c[1] + (self.backward_input_s - c[1]) * factor,
                       backward_weight_s=c[2] + (self.backward_weight_s - c[2]) * factor,
                       activation_bytes=round(self.activation_bytes * factor),
                       output_bytes=round(self.output_bytes * factor),
                       output_grad_bytes=round(self.output_grad_bytes * factor), backward_fused_s=fused,
                       tp=self.tp.scaled(factor) if self.tp is not None else None,
                       selective_activation_bytes=None if self.selective_activation_bytes is None else
                       round(self.selective_activation_bytes * factor),
                       selective_held_bytes=None if self.selective_held_bytes is None else
                       round(self.selective_held_bytes * factor),
                       selective_recompute_s=None if self.selective_recompute_s is None else
                       self.selective_recompute_s * factor)

    @property
    def times(self) -> tuple[float, float, float]:
        """(F, I, W) seconds."""
        return self.forward_s, self.backward_input_s, self.backward_weight_s

    @property
    def full_backward_s(self) -> float:
        """What a B action costs: the measured fused backward, else I + W."""
        return self.backward_fused_s if self.backward_fused_s is not None else self.backward_s

    def linear(self) -> PartProfile:
        """This part as profiles before affine fits and fused backward times saw it (times scale linearly,
        B costs I + W)."""
        return replace(self, forward_fixed_s=None, backward_input_fixed_s=None, backward_weight_fixed_s=None,
                       backward_fused_s=None, backward_fused_fixed_s=None)


def check_work_terms(terms: Any, label: str, error: type[ValueError]) -> None:
    """Raise `error` (naming `label` and the field) unless `terms`' action_s, message_s and step_s are finite
    numbers >= 0 and its compute_scale and wall_scale finite numbers > 0 (RuntimeOverhead and the simulator's
    Machine)."""
    for name in ("action_s", "message_s", "step_s"):
        value = getattr(terms, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise error(f"{label} {name} must be a finite number >= 0, got {value!r}")
    for name in ("compute_scale", "wall_scale"):
        scale = getattr(terms, name)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise error(f"{label} {name} must be a finite number > 0, got {scale!r}")


@dataclass(frozen=True)
class RuntimeOverhead:
    """Work the runtime adds to the parts' compute, per rank, measured by a calibration run (seconds of CPU)."""

    action_s: float
    """Per compute action (F, B, I, W or an F&B pair): dispatch and bookkeeping beyond the part's own time."""
    message_s: float
    """Per SEND or RECV: posting it, waiting on it and handing the tensor over."""
    step_s: float
    """Per step: what a rank does once (loss and norm collectives, optimizer bookkeeping)."""
    method: str = ""
    """How it was measured (for reports)."""
    compute_scale: float = 1.0
    """alpha: a part's CPU time inside a running pipeline over its profiled time (a calibration with the
    real parts measures it; 1 when the calibration ran 1-weight parts or in older profiles)."""
    wall_scale: float = 1.0
    """Every simulated time is multiplied by it: the calibration runs' measured wall time over the model's (what
    the model of the machine leaves out: a woken rank waiting for a core, other processes); 1: none known."""

    def __post_init__(self) -> None:
        check_work_terms(self, "runtime overhead", ProfileError)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {"action_s": self.action_s, "message_s": self.message_s, "step_s": self.step_s,
                "method": self.method, "compute_scale": self.compute_scale, "wall_scale": self.wall_scale}

    @staticmethod
    def from_dict(data: Any, where: str) -> RuntimeOverhead:
        """Inverse of `to_dict`; ProfileError names the bad field."""
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: expected an object, got {type(data).__name__}")
        for name in ("action_s", "message_s", "step_s"):
            if name not in data:
                raise ProfileError(f"{where}: missing field {name!r}")
        try:
            return RuntimeOverhead(data["action_s"], data["message_s"], data["step_s"], str(data.get("method", "")),
                                   data.get("compute_scale", 1.0), data.get("wall_scale", 1.0))
        except ProfileError as exc:
            raise ProfileError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class Profile:
    """What `duplexpipe.train.planning.measure.profile_parts` measured, one entry per model part, in order."""

    parts: tuple[PartProfile, ...]
    """The model parts, first to last."""
    microbatch_size: int
    """Samples in the microbatch the parts were measured on."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form facts about the run (task, repeats, torch version, device)."""
    overhead: RuntimeOverhead | None = None
    """The runtime's own work per action, message and step (None: not measured, taken as zero)."""
    tp_degrees: tuple[int, ...] | None = None
    """The tensor-parallel degrees (2 to `TP_DEGREES_CHECKED`) the plan it was profiled with can shard every part
    with (every sharded dimension and head count divisible); None: profiled without a plan."""

    def __post_init__(self) -> None:
        if not self.parts:
            raise ProfileError("a profile needs at least one part, got none")
        if not isinstance(self.microbatch_size, int) or isinstance(self.microbatch_size, bool) \
                or self.microbatch_size < 1:
            raise ProfileError(f"profile microbatch_size must be an integer >= 1, got {self.microbatch_size!r}")

    @property
    def num_parts(self) -> int:
        """How many parts were measured."""
        return len(self.parts)

    def check_parts(self, num_parts: int) -> None:
        """Raise ProfileError unless the profile has exactly `num_parts` parts (it must match the model)."""
        if num_parts != self.num_parts:
            raise ProfileError(f"the profile has {self.num_parts} parts, but the model has {num_parts}: "
                               "profile the model as it is split")

    def at_microbatch(self, size: float) -> Profile:
        """The profile scaled linearly to microbatches of `size` samples (times and activation bytes)."""
        if not size > 0:
            raise ProfileError(f"microbatch size must be > 0, got {size!r}")
        factor = size / self.microbatch_size
        return replace(self, parts=tuple(p.scaled(factor) for p in self.parts))

    def basic(self) -> Profile:
        """This profile as the planner saw it before affine fits and overheads (linear times, no overhead)."""
        return replace(self, parts=tuple(p.linear() for p in self.parts), overhead=None)

    def group_sizes(self, num_groups: int) -> list[int]:
        """How many parts each of `num_groups` contiguous groups of near-equal F+B time takes (at the
        profiled microbatch; the planner groups every candidate this way, so its grouping is the one
        `train.planning` and `partition.balanced_split` on these times rebuild). ProfileError when there are
        fewer parts than groups."""
        if num_groups > self.num_parts:
            raise ProfileError(f"the profile has {self.num_parts} parts; {num_groups} model parts need a "
                               f"profile of at least {num_groups} parts")
        return balanced_split([p.forward_s + p.backward_s for p in self.parts], num_groups)

    def grouped(self, num_groups: int, sizes: list[int] | None = None) -> tuple[PartProfile, ...]:
        """The parts merged into `num_groups` contiguous groups: `sizes` parts each (default
        `group_sizes(num_groups)`, near-equal F+B time).

        A group's times (and fixed parts, when all of its parts have them), activation and
        parameter bytes are the sums of its parts'; its messages are its last part's. Raises
        ProfileError when there are fewer parts than groups.
        """
        counts = sizes if sizes is not None else self.group_sizes(num_groups)
        if len(counts) != num_groups or sum(counts) != self.num_parts or min(counts) < 1:
            raise ProfileError(f"group sizes {counts} do not split {self.num_parts} parts into {num_groups} groups")
        out, start = [], 0
        for count in counts:
            run = self.parts[start:start + count]
            out.append(PartProfile(
                sum(p.forward_s for p in run), sum(p.backward_input_s for p in run),
                sum(p.backward_weight_s for p in run), sum(p.activation_bytes for p in run),
                sum(p.param_bytes for p in run), run[-1].output_bytes, run[-1].output_grad_bytes,
                forward_fixed_s=_sum([p.forward_fixed_s for p in run]),
                backward_input_fixed_s=_sum([p.backward_input_fixed_s for p in run]),
                backward_weight_fixed_s=_sum([p.backward_weight_fixed_s for p in run]),
                backward_fused_s=_sum([p.backward_fused_s for p in run]),
                backward_fused_fixed_s=_sum([p.backward_fused_fixed_s for p in run]),
                tp=TPFacts.total([p.tp for p in run]),
                selective_activation_bytes=_total([p.selective_activation_bytes for p in run]),
                selective_held_bytes=_total([p.selective_held_bytes for p in run]),
                selective_recompute_s=_sum([p.selective_recompute_s for p in run])))
            start += count
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (format "duplexpipe-profile", version 1)."""
        out = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "microbatch_size": self.microbatch_size,
               "parts": [{f.name: getattr(p, f.name) for f in fields(PartProfile)
                          if getattr(p, f.name) is not None and f.name != "tp"}
                         | ({"tp": p.tp.to_dict()} if p.tp is not None else {}) for p in self.parts],
               "meta": dict(self.meta)}
        if self.overhead is not None:
            out["overhead"] = self.overhead.to_dict()
        if self.tp_degrees is not None:
            out["tp_degrees"] = list(self.tp_degrees)
        return out

    @staticmethod
    def from_dict(data: Any, source: str = "profile") -> Profile:
        """Inverse of `to_dict`; raises ProfileError naming the missing or bad field."""
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{source}: not a duplexpipe profile (format {data.get('format')!r}, expected "
                               f"{PROFILE_FORMAT!r})")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{source}: unsupported profile version {data.get('version')!r} "
                               f"(this duplexpipe reads {PROFILE_VERSION})")
        parts = data.get("parts")
        if not isinstance(parts, list) or not parts:
            raise ProfileError(f"{source}: missing field 'parts' (a non-empty list)")
        size = data.get("microbatch_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ProfileError(f"{source}: field 'microbatch_size' must be an integer >= 1, got {size!r}")
        meta = data.get("meta", {})
        overhead = data.get("overhead")
        return Profile(tuple(_part(p, f"{source}: parts[{i}]") for i, p in enumerate(parts)), size,
                       meta if isinstance(meta, dict) else {},
                       None if overhead is None else RuntimeOverhead.from_dict(overhead, f"{source}: overhead"),
                       _degrees(data.get("tp_degrees"), f"{source}: tp_degrees"))


def _sum(values: list[float | None]) -> float | None:
    """The sum, or None when any is None."""
    return None if any(v is None for v in values) else sum(v or 0.0 for v in values)


def _total(values: list[int | None]) -> int | None:
    """The sum of byte counts, or None when any is None."""
    return None if any(v is None for v in values) else sum(v or 0 for v in values)


def _degrees(data: Any, where: str) -> tuple[int, ...] | None:
    """A profile's tp_degrees (absent: None); ProfileError unless a list of integers in [2, TP_DEGREES_CHECKED]."""
    if data is None:
        return None
    if not isinstance(data, list) or any(isinstance(d, bool) or not isinstance(d, int)
                                         or not 2 <= d <= TP_DEGREES_CHECKED for d in data):
        raise ProfileError(f"{where}: expected a list of integers from 2 to {TP_DEGREES_CHECKED}, got {data!r}")
    return tuple(data)


def _part(data: Any, where: str) -> PartProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected an object, got {type(data).__name__}")
    values: dict[str, Any] = {}
    if data.get("tp") is not None:
        values["tp"] = TPFacts.from_dict(data["tp"], f"{where}: tp")
    for f in fields(PartProfile):
        if f.name == "tp":
            continue
        optional = f.name.endswith("_fixed_s") or f.name == "backward_fused_s" or \
            f.name.startswith("selective_")  # absent in older profiles
        if f.name not in data and not optional:
            raise ProfileError(f"{where}: missing field {f.name!r}")
        value = data.get(f.name)
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ProfileError(f"{where}: field {f.name!r} must be a finite number >= 0, got {value!r}")
        limit, unit = (MAX_PART_BYTES, "bytes") if f.name.endswith("_bytes") else (MAX_PART_SECONDS, "seconds")
        if value > limit:
            raise ProfileError(f"{where}: field {f.name!r} is {value!r}, over {limit:,} {unit}; the planner's sums "
                               "of such costs overflow (a profile measures one part on one microbatch)")
        if f.name.endswith("_bytes") and value != int(value):
            raise ProfileError(f"{where}: field {f.name!r} must be a whole number of bytes, got {value!r}")
        values[f.name] = int(value) if f.name.endswith("_bytes") else float(value)
    for name in ("forward", "backward_input", "backward_weight", "backward_fused"):
        fixed = values.get(f"{name}_fixed_s")
        if fixed is not None and fixed > values.get(f"{name}_s", math.inf):
            raise ProfileError(f"{where}: field '{name}_fixed_s' ({fixed!r}) exceeds '{name}_s' "
                               f"({values[f'{name}_s']!r}): the fixed part is a part of the time")
    return PartProfile(**values)


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write `profile` as JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(profile.to_dict(), fh, indent=1)
        fh.write("\n")


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a profile JSON file (refused over MAX_PROFILE_FILE_BYTES before it is parsed); ProfileError names the
    file and the problem."""
    name = os.fspath(path)
    try:
        data = json.loads(read_capped_text(name, MAX_PROFILE_FILE_BYTES, "profile", ProfileError))
    except OSError as exc:
        raise ProfileError(f"cannot read profile {name!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {name!r} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise ProfileError(f"profile {name!r} is nested too deeply to be a profile") from None
    return Profile.from_dict(data, f"profile {name!r}")
