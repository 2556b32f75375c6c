"""Mixed precision: autocast dtypes and a dynamic loss scaler whose decisions every rank shares."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16", "fp16")


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype for a precision name: None (fp32), bfloat16 or float16."""
    table = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in table:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    return table[precision]


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (the usual grow-on-success, back-off-on-overflow rule)."""

    init_scale: float = 2.0**16
    """The loss scale of the first step."""
    growth_factor: float = 2.0
    """Multiply the scale by this after `growth_interval` overflow-free optimizer steps in a row."""
    backoff_factor: float = 0.5
    """Multiply the scale by this when a step overflows (the step is skipped on every rank)."""
    growth_interval: int = 2000
    """Overflow-free steps in a row before the scale grows."""
    min_scale: float = 1.0
    """The scale never backs off below this."""

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"LossScaleConfig.{name} must be a finite number, got {value!r}")
        if self.init_scale <= 0 or self.min_scale <= 0:
            raise ValueError(
                f"init_scale and min_scale must be > 0, got {self.init_scale} and {self.min_scale}")
        if self.growth_factor < 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"need growth_factor >= 1 and 0 < backoff_factor < 1, got {self.growth_factor} "
                f"and {self.backoff_factor}"
            )
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval!r} (an int)")


class DynamicLossScaler:
    """The loss scale and its update rule.

    It holds no communication: the trainer reduces the overflow flag over all ranks first and
    calls `update` with that shared verdict, so the scale stays equal everywhere.
    """

    def __init__(self, config: LossScaleConfig | None = None, enabled: bool = True) -> None:
        self.config = config or LossScaleConfig()
        self.enabled = enabled
        self.scale = self.config.init_scale if enabled else 1.0
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Back off after an overflow; grow after `growth_interval` clean steps in a row. Disabled (fp32, bf16), it
        only counts the skipped steps (SafetyConfig.nonfinite_grads="skip")."""
        if overflow:
            self.skipped_steps += 1
        if not self.enabled:
            return
        cfg = self.config
        if overflow:
            self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= cfg.growth_interval:
            self.scale *= cfg.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Scale and counters (for checkpoints)."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
