"""Tests for duplexpipe.launch.train_config: validation, schedule files, the LR schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from duplexpipe.launch.train_config import CheckpointConfig, MetricsConfig, OptimizerConfig, TrainConfig, lr_factor
from duplexpipe.launch.train_settings import merge_config
from duplexpipe.schedules import registry
from duplexpipe.schedules.ir import save_json
from duplexpipe.train.pipeline_config import PipelineConfig, is_schedule_file


def test_config_validates_values_and_names_them() -> None:
    assert TrainConfig(pipeline=PipelineConfig("dualpipe", 8), ranks=4).parts_needed() == 4
    assert TrainConfig(pipeline=PipelineConfig("dualpipev", 8), ranks=4).parts_needed() == 8
    off = merge_config({"pipeline": {"grad_clip_norm": 0.0}}, {})  # 0 turns clipping off (TOML has no None)
    assert off.pipeline.grad_clip_norm is None and merge_config({}, {}).pipeline.grad_clip_norm == 1.0
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="warmup must be >= 0, got -1"):
        OptimizerConfig(warmup=-1)
    with pytest.raises(ValueError, match="lr_schedule must be one of constant, cosine, linear, got 'step'"):
        OptimizerConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="optimizer name must be one of adamw, sgd, got 'lion'"):
        OptimizerConfig("lion")
    with pytest.raises(ValueError, match="lr=0"):
        OptimizerConfig(lr=0)
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        TrainConfig(dp=4, ep=3)
    with pytest.raises(ValueError, match="eval_every must be >= 0, got -1"):
        MetricsConfig(eval_every=-1)
    with pytest.raises(ValueError, match="save_every must be >= 0, got -1"):
        CheckpointConfig(save_every=-1)
    with pytest.raises(ValueError, match="min_lr_ratio must be in"):
        OptimizerConfig(min_lr_ratio=2)
    with pytest.raises(ValueError, match="batch_size 4 is smaller than microbatches x dp = 8 x 1"):
        TrainConfig(batch_size=4)
    with pytest.raises(ValueError, match="sequence_parallel .* needs tp > 1"):
        TrainConfig(pipeline=PipelineConfig(sequence_parallel=True))


def test_a_schedule_file_states_its_ranks_and_microbatches(tmp_path: Path) -> None:
    path = tmp_path / "mine.JSON"
    save_json(registry.build("zbv", 2, 4), str(path))
    assert is_schedule_file(str(path)) and not is_schedule_file("zbv")
    schedule = TrainConfig(pipeline=PipelineConfig(str(path), 4), ranks=2).schedule_object()
    assert (schedule.num_ranks, schedule.num_microbatches, schedule.num_groups) == (2, 4, 4)
    assert TrainConfig(pipeline=PipelineConfig("interleaved-1f1b", schedule_options={"chunks": 3}), ranks=2
                       ).parts_needed() == 6
    with pytest.raises(ValueError, match="is for 2 ranks, but the pipeline group has 4"):
        TrainConfig(pipeline=PipelineConfig(str(path), 4), ranks=4).schedule_object()


def test_lr_factor_warms_up_then_decays() -> None:
    constant = lr_factor("constant", 4, 20, 0.1)
    assert [constant(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = lr_factor("cosine", 2, 12, 0.1)  # decays over steps 2..11
    assert cosine(1) == 1.0 and cosine(2) == 1.0 and cosine(11) == pytest.approx(0.1)
    assert cosine(20) == pytest.approx(0.1)
    assert cosine(2 + 9 / 2) == pytest.approx(0.55)  # half way: the mean of 1 and 0.1
    values = [cosine(s) for s in range(2, 12)]
    assert values == sorted(values, reverse=True)
    linear = lr_factor("linear", 0, 11, 0.0)
    assert [linear(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    assert all(math.isfinite(lr_factor("cosine", 0, 1, 0.0)(s)) for s in range(3))  # one step: no division by 0
    with pytest.raises(ValueError, match="lr schedule must be one of"):
        lr_factor("exp", 0, 10, 0.1)
