"""RuntimeConfig validation and result types."""

from __future__ import annotations

import pytest
import torch

from duplexpipe.runtime import EvalResult, RuntimeConfig, StepResult


def test_defaults_match_the_documented_interface() -> None:
    config = RuntimeConfig()
    assert config.timeout_s == 180.0 and config.record_timeline and config.sum_mirrored_grads
    assert config.autocast_dtype is None and config.overlap_hook is None


@pytest.mark.parametrize("kwargs, needle", [
    ({"timeout_s": 0}, "timeout_s must be > 0, got 0"),
    ({"poll_interval_s": -1.0}, "poll_interval_s must be > 0, got -1.0"),
    ({"autocast_dtype": "bf16"}, "autocast_dtype must be a torch.dtype or None, got 'bf16'"),
    ({"overlap_hook": 3}, "overlap_hook must be callable, got 3"),
])
def test_bad_values_raise_value_error_naming_them(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        RuntimeConfig(**kwargs)  # type: ignore[arg-type]


def test_results_hold_what_they_are_given() -> None:
    assert StepResult(loss=1.5, timeline=None, peak_activations=3).peak_activations == 3
    out = torch.zeros(2)
    assert EvalResult(outputs=out, loss=None, timeline=None).outputs is out
