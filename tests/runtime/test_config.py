"""RuntimeConfig validation and result types."""

from __future__ import annotations

import pickle

import pytest
import torch

from duplexpipe.runtime import EvalResult, RuntimeConfig, StepResult


def test_defaults_match_the_documented_interface() -> None:
    config = RuntimeConfig()
    assert config.timeout_s == 180.0 and config.record_timeline and config.sum_mirrored_grads
    assert config.autocast_dtype is None and not config.fb_overlap
    assert config.check_inputs_every_step and config.recv_lookahead == 2


@pytest.mark.parametrize("kwargs, needle", [
    ({"timeout_s": 0}, "timeout_s must be > 0, got 0"),
    ({"poll_interval_s": -1.0}, "poll_interval_s must be > 0, got -1.0"),
    ({"autocast_dtype": "bf16"}, "autocast_dtype must be a torch.dtype or None, got 'bf16'"),
    ({"on_grads_ready": 3}, "on_grads_ready must be callable, got 3"),
    ({"fb_overlap": 1}, "fb_overlap must be a bool, got 1"),
    ({"check_inputs_every_step": 0}, "check_inputs_every_step must be a bool, got 0"),
    ({"count_saved_bytes": "no"}, "count_saved_bytes must be a bool, got 'no'"),
])
def test_bad_values_raise_value_error_naming_them(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        RuntimeConfig(**kwargs)  # type: ignore[arg-type]


def test_results_hold_what_they_are_given() -> None:
    assert StepResult(loss=1.5, timeline=None, peak_activations=3).peak_activations == 3
    out = torch.zeros(2)
    assert EvalResult(outputs=out, loss=None, timeline=None).outputs is out


def test_step_result_loss_is_computed_once_on_first_read() -> None:
    calls: list[int] = []

    def finish() -> float:
        calls.append(1)
        return 2.5

    result = StepResult(loss=finish, timeline=None, peak_activations=1)
    assert "loss=<pending>" in repr(result) and not calls
    assert result.loss == 2.5 and result.loss == 2.5
    assert len(calls) == 1
    assert "loss=2.5" in repr(result)


def test_step_result_pickles_with_its_loss_resolved() -> None:
    result = pickle.loads(pickle.dumps(StepResult(loss=lambda: 0.75, timeline=None, peak_activations=2)))
    assert (result.loss, result.timeline, result.peak_activations) == (0.75, None, 2)
    assert result == StepResult(loss=0.75, timeline=None, peak_activations=2)
    assert result != StepResult(loss=0.5, timeline=None, peak_activations=2)


def test_step_result_loss_read_raises_what_the_wait_raised() -> None:
    def failed() -> float:
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError, match="peer gone"):
        _ = StepResult(loss=failed, timeline=None, peak_activations=0).loss
