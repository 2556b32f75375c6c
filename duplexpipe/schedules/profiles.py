"""Profile: measured per-part costs and bytes of a model, as JSON, usable without torch."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

PROFILE_FORMAT = "duplexpipe-profile"
PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file or object is malformed or does not fit what it is used for."""


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

    @property
    def backward_s(self) -> float:
        """I + W: a full backward."""
        return self.backward_input_s + self.backward_weight_s

    def scaled(self, factor: float) -> PartProfile:
        """Times and per-microbatch bytes times `factor` (a microbatch `factor` times as large); params kept."""
        return PartProfile(self.forward_s * factor, self.backward_input_s * factor,
                           self.backward_weight_s * factor, round(self.activation_bytes * factor),
                           self.param_bytes, round(self.output_bytes * factor),
                           round(self.output_grad_bytes * factor))


@dataclass(frozen=True)
class Profile:
    """What `duplexpipe.pipeline.profile_parts` measured, one entry per model part, in order."""

    parts: tuple[PartProfile, ...]
    """The model parts, first to last."""
    microbatch_size: int
    """Samples in the microbatch the parts were measured on."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form facts about the run (task, repeats, torch version, device)."""

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

    def grouped(self, num_groups: int) -> tuple[PartProfile, ...]:
        """The parts merged into `num_groups` contiguous groups of near-equal F+B time.

        A group's times, activation and parameter bytes are the sums of its parts'; its
        messages are its last part's. Raises ProfileError when there are fewer parts than groups.
        """
        if num_groups > self.num_parts:
            raise ProfileError(f"the profile has {self.num_parts} parts; {num_groups} model parts need a "
                               f"profile of at least {num_groups} parts")
        counts = balanced_split([p.forward_s + p.backward_s for p in self.parts], num_groups)
        out, start = [], 0
        for count in counts:
            run = self.parts[start:start + count]
            out.append(PartProfile(sum(p.forward_s for p in run), sum(p.backward_input_s for p in run),
                                   sum(p.backward_weight_s for p in run), sum(p.activation_bytes for p in run),
                                   sum(p.param_bytes for p in run), run[-1].output_bytes,
                                   run[-1].output_grad_bytes))
            start += count
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (format "duplexpipe-profile", version 1)."""
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "microbatch_size": self.microbatch_size,
                "parts": [{f.name: getattr(p, f.name) for f in fields(PartProfile)} for p in self.parts],
                "meta": dict(self.meta)}

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
        return Profile(tuple(_part(p, f"{source}: parts[{i}]") for i, p in enumerate(parts)), size,
                       meta if isinstance(meta, dict) else {})


def _part(data: Any, where: str) -> PartProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected an object, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for f in fields(PartProfile):
        if f.name not in data:
            raise ProfileError(f"{where}: missing field {f.name!r}")
        value = data[f.name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ProfileError(f"{where}: field {f.name!r} must be a finite number >= 0, got {value!r}")
        if f.name.endswith("_bytes") and value != int(value):
            raise ProfileError(f"{where}: field {f.name!r} must be a whole number of bytes, got {value!r}")
        values[f.name] = int(value) if f.name.endswith("_bytes") else float(value)
    return PartProfile(**values)


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write `profile` as JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(profile.to_dict(), fh, indent=1)
        fh.write("\n")


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a profile JSON file; ProfileError names the file and the problem."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ProfileError(f"cannot read profile {name!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {name!r} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    return Profile.from_dict(data, f"profile {name!r}")


def balanced_split(costs: list[float], num_groups: int) -> list[int]:
    """Sizes of `num_groups` contiguous non-empty runs of `costs` whose largest sum is smallest.

    Ties go to the split with shorter early runs (deterministic).
    """
    n = len(costs)
    if not 1 <= num_groups <= n:
        raise ProfileError(f"cannot split {n} parts into {num_groups} groups")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[math.inf] * (n + 1) for _ in range(num_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(num_groups + 1)]
    best[0][0] = 0.0
    for k in range(1, num_groups + 1):
        for i in range(k, n - (num_groups - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12 * max(1.0, value):
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(num_groups, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]
