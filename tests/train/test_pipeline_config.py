"""duplexpipe.config (re-exported by duplexpipe.train.pipeline_config): the configuration is grouped in small
sections (no public config class over 15 fields), `PipelineConfig("1f1b", 8)` is the one-line start, and a
section's field is set through its section."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

from duplexpipe.launch.train_settings import _hints, _nested
from duplexpipe.train.pipeline_config import (
    DataParallelConfig,
    ObserveConfig,
    PipelineConfig,
    PrecisionConfig,
    SafetyConfig,
    with_choice,
    with_defaults,
)

CONFIG_MODULES = ("duplexpipe.config.pipeline", "duplexpipe.config.sections", "duplexpipe.config.precision",
                  "duplexpipe.launch.train_config", "duplexpipe.runtime.config", "duplexpipe.dp_options.zero")
"""The public configuration modules: PipelineConfig and its sections, TrainConfig and its sections, RuntimeConfig,
and the options tables they hold."""
MAX_FIELDS = 15


def _reachable(cls: type, seen: set[type]) -> None:
    seen.add(cls)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        nested = _nested(hints[f.name])
        if nested is not None and nested not in seen:
            _reachable(nested, seen)


def test_no_public_config_class_has_more_than_15_fields() -> None:
    classes: set[type] = set()
    for name in CONFIG_MODULES:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and dataclasses.is_dataclass(cls) and not cls.__name__.startswith("_") \
                    and cls.__name__.endswith(("Config", "Options")):
                _reachable(cls, classes)
    names = {cls.__name__ for cls in classes}
    assert {"PipelineConfig", "TrainConfig", "RuntimeConfig", "PrecisionConfig", "DataParallelConfig",
            "SafetyConfig", "ObserveConfig", "OptimizerConfig", "MetricsConfig", "CheckpointConfig",
            "LossScaleConfig", "ZeroOptions"} <= names, names
    wide = {cls.__name__: len(dataclasses.fields(cls)) for cls in classes if len(dataclasses.fields(cls)) > MAX_FIELDS}
    assert not wide, f"config classes over {MAX_FIELDS} fields (group them in sections): {wide}"


def test_the_one_line_start_and_the_sections() -> None:
    config = PipelineConfig("1f1b", 8)
    assert (config.schedule, config.num_microbatches) == ("1f1b", 8)
    assert (config.precision, config.data_parallel, config.safety, config.observe) == (
        PrecisionConfig(), DataParallelConfig(), SafetyConfig(), ObserveConfig())
    with pytest.raises(TypeError):
        PipelineConfig(zero_stage=1)  # type: ignore[call-arg]  # a section's field is set through its section
    with pytest.raises(ValueError, match="PipelineConfig.data_parallel must be a DataParallelConfig, got"):
        PipelineConfig(data_parallel={"zero_stage": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        SafetyConfig(timeout_s=0)
    with pytest.raises(ValueError, match="grad_bucket_bytes must be an int >= 1, got 0"):
        DataParallelConfig(grad_bucket_bytes=0)


def test_defaults_and_a_choice_set_the_data_parallel_section() -> None:
    resolved = with_defaults(PipelineConfig("1f1b", data_parallel=DataParallelConfig(grad_compression="bf16")))
    assert (resolved.num_microbatches, resolved.data_parallel.zero_stage,
            resolved.data_parallel.grad_compression) == (4, 0, "bf16")
    chosen = with_choice(PipelineConfig("1f1b"), 8, 1, "int8")
    assert (chosen.num_microbatches, chosen.data_parallel.zero_stage, chosen.data_parallel.grad_compression) == (
        8, 1, "int8")
