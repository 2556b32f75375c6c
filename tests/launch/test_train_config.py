"""Tests for duplexpipe.launch.train_config: validation, the TOML file, precedence, the LR schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from duplexpipe.launch.train_config import (
    TrainConfig,
    check_keys,
    load_config_file,
    lr_factor,
    merge_config,
)


def test_config_validates_values_and_names_them() -> None:
    assert TrainConfig(schedule="dualpipe", ranks=4).parts_needed() == 4
    assert TrainConfig(schedule="dualpipev", ranks=4).parts_needed() == 8
    assert TrainConfig(grad_clip_norm=0.0).grad_clip_norm is None  # 0 turns clipping off
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="warmup must be >= 0, got -1"):
        TrainConfig(warmup=-1)
    with pytest.raises(ValueError, match="lr_schedule must be one of constant, cosine, linear, got 'step'"):
        TrainConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="optimizer must be one of adamw, sgd, got 'lion'"):
        TrainConfig(optimizer="lion")
    with pytest.raises(ValueError, match="lr=0"):
        TrainConfig(lr=0)
    with pytest.raises(ValueError, match="p2p_compression must be one of none, bf16, fp8, int8, got 'fp4'"):
        TrainConfig(p2p_compression="fp4")
    with pytest.raises(ValueError, match="min_lr_ratio must be in"):
        TrainConfig(min_lr_ratio=2)


def test_keys_are_checked_by_name_and_type() -> None:
    assert check_keys({"batch-size": 8, "lr": 1, "grad_clip_norm": 2}, "x") == {
        "batch_size": 8, "lr": 1.0, "grad_clip_norm": 2.0}
    with pytest.raises(ValueError, match=r"x: unknown keys \['learning_rate'\]; valid keys: task, task_options"):
        check_keys({"learning_rate": 1e-3}, "x")
    with pytest.raises(ValueError, match="batch_size must be int, got '8'"):
        check_keys({"batch_size": "8"}, "x")
    with pytest.raises(ValueError, match="steps must be int, got True"):
        check_keys({"steps": True}, "x")
    with pytest.raises(ValueError, match="task_options must be dict, got 3"):
        check_keys({"task_options": 3}, "x")


def test_config_file_and_flags_override_it(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('schedule = "1f1b"\nranks = 2\nlr = 1e-3\nbatch-size = 16\nwarmup = 5\n'
                    '[task_options]\nn_layer = 2\nd_model = 16\n')
    values = load_config_file(str(path))
    config = merge_config(values, {"lr": 5e-4, "task_options": {"d_model": 32}})
    assert (config.schedule, config.ranks, config.batch_size, config.warmup) == ("1f1b", 2, 16, 5)
    assert config.lr == 5e-4  # the flag wins
    assert config.task_options == {"n_layer": 2, "d_model": 32}
    assert merge_config({}, {}) == TrainConfig()


def test_bad_config_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config file .*missing.toml: cannot read it \(No such file"):
        load_config_file(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("lr = = 3\n")
    with pytest.raises(ValueError, match="bad.toml: not valid TOML"):
        load_config_file(str(bad))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("epochs = 3\n")
    with pytest.raises(ValueError, match=r"unknown.toml: unknown keys \['epochs'\]"):
        load_config_file(str(unknown))


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
