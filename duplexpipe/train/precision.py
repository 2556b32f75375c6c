"""Mixed precision: autocast dtypes and a dynamic loss scaler whose decisions every rank shares."""

from __future__ import annotations

from typing import Any

import torch

from duplexpipe.config.precision import PRECISIONS as PRECISIONS
from duplexpipe.config.precision import LossScaleConfig, check_precision


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype for a precision name (`config.precision.PRECISIONS`): None (fp32), bfloat16 or float16."""
    table = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    return table[check_precision(precision)]


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
