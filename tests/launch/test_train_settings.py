"""Tests for duplexpipe.launch.train_settings: every field of TrainConfig and of its sections (its PipelineConfig and
that one's sections among them) is a flag and a config-file key generated from the field (its type, its docstring), so
`--help`, the TOML file and the dataclasses are one list; keys are type-checked, flags override the file, tables build
the sections and options objects."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from duplexpipe.comm.p2p_codecs import Fp8RowCodec, Int8BlockCodec, p2p_codec_pair
from duplexpipe.dp_options.compression import PowerSGDOptions, compression_options
from duplexpipe.fielddoc import field_docs
from duplexpipe.launch.train_config import TrainConfig, default_pipeline
from duplexpipe.launch.train_settings import (
    HIDDEN,
    _hints,
    _nested,
    add_arguments,
    check_keys,
    load_config_file,
    merge_config,
    parse_key_values,
    settings,
    values_from_args,
    writable,
)
from duplexpipe.train.pipeline_config import DataParallelConfig, PipelineConfig, PrecisionConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def _config(argv: list[str], file_values: dict[str, object] | None = None) -> TrainConfig:
    return merge_config(file_values or {}, values_from_args(_parser().parse_args(argv)))


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """(key, owner class, field name) of every field of `cls`, a dataclass field's fields in its place."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        nested = _nested(hints[f.name])
        if nested is not None:
            out += _leaves(nested, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", cls, f.name))
    return out


def test_every_config_field_is_a_documented_flag_or_hidden_with_a_reason() -> None:
    """Walk the dataclasses: a new field of TrainConfig or of any section is a flag as soon as it exists."""
    parser = _parser()
    flags: dict[str, argparse.Action] = {}
    for action in parser._actions:  # noqa: SLF001 - the parser's own table of options
        flags.setdefault(action.dest, action)  # a switch's --no- twin comes second
    for key, owner, name in _leaves(TrainConfig):
        if key in HIDDEN:
            continue
        assert writable(_hints(owner)[name]), f"{key}: a type the command line cannot write; list it in HIDDEN " \
                                              "with the reason"
        assert key in flags, f"{key} has no flag"
        assert field_docs(owner)[name] in (flags[key].help or "").replace("%%", "%"), key  # the field's docstring
    for key in ("pipeline.accumulation_steps", "pipeline.fb_overlap", "pipeline.data_parallel.zero.hpz_ranks",
                "pipeline.precision.loss_scale.init_scale", "pipeline.schedule_options", "tp",
                "pipeline.sequence_parallel", "pipeline.observe.record_tp_lane", "metrics.timeline_every"):
        assert key in flags, key
    assert all(reason for reason in HIDDEN.values())
    assert len({s.flags[0] for s in settings()}) == len(settings()), "one flag per setting"
    assert "+11-21% CPU" in " ".join(parser.format_help().split())  # a docstring's % survives argparse


def test_flag_pairs_say_what_the_default_is() -> None:
    """--no-tensorboard's help read 'Write TensorBoard scalars ... (default True)', the opposite of the flag."""
    help_text = _parser().format_help().replace("\n", " ")
    assert "--tensorboard, --no-tensorboard" in help_text and "(default True)" not in help_text
    tensorboard = next(s for s in settings() if s.key == "metrics.tensorboard")
    assert tensorboard.help().endswith("(default on)")
    assert _config(["--no-tensorboard"]).metrics.tensorboard is False and _config([]).metrics.tensorboard is True


def test_pipeline_settings_reach_the_pipeline_config() -> None:
    config = _config(["--accumulation-steps", "2", "--no-fb-overlap", "--zero-hpz-ranks", "2", "--zero-stage", "2",
                      "--dp", "4", "--ep", "2", "--opt", "chunks=2", "--schedule", "interleaved-1f1b", "--ranks", "2",
                      "--loss-scale-init-scale", "1024"])
    pcfg = config.pipeline
    assert (pcfg.accumulation_steps, pcfg.fb_overlap, pcfg.data_parallel.zero.hpz_ranks,
            pcfg.precision.loss_scale.init_scale, pcfg.schedule_options) == (2, False, 2, 1024.0, {"chunks": 2})
    assert config.schedule_object().num_groups == 4 and config.ep == 2  # chunks=2 on 2 ranks
    assert TrainConfig().pipeline == default_pipeline() == PipelineConfig(
        schedule="dualpipe", num_microbatches=8, grad_clip_norm=1.0, data_parallel=DataParallelConfig(zero_stage=0))


def test_compression_options_are_written_as_labels() -> None:
    """p2p and gradient compression objects beyond the bare names, as text on the command line and in TOML."""
    config = _config(["--p2p-compression", "int8(block=128), none", "--grad-compression", "powersgd(rank=1)"])
    act, grad = p2p_codec_pair(config.pipeline.precision.p2p_compression)
    assert isinstance(act, Int8BlockCodec) and act.block == 128 and grad is None
    assert compression_options(config.pipeline.data_parallel.grad_compression) == PowerSGDOptions(rank=1)
    act, grad = p2p_codec_pair("fp8")
    assert isinstance(act, Fp8RowCodec) and isinstance(grad, Fp8RowCodec) and (act.fmt, grad.fmt) == ("e4m3", "e5m2")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['size'\]; int8 takes block, stochastic_seed"):
        p2p_codec_pair("int8(size=3)")
    with pytest.raises(ValueError, match=r"unknown p2p_compression 'fp4'"):
        PrecisionConfig(p2p_compression="fp4")
    with pytest.raises(ValueError, match=r"powersgd\(rnk=1\).*unknown option\(s\) \['rnk'\]; it takes rank"):
        compression_options("powersgd(rnk=1)")
    with pytest.raises(ValueError, match="bad options"):
        _config(["--grad-compression", "powersgd(rank=__import__('os'))"])


def test_keys_are_checked_by_name_and_type() -> None:
    assert check_keys({"batch-size": 8, "optimizer": {"lr": 1}, "pipeline.grad_clip_norm": 2}, "x") == {
        "batch_size": 8, "optimizer.lr": 1.0, "pipeline.grad_clip_norm": 2.0}
    assert check_keys({"pipeline": {"data_parallel": {"zero": {"hpz_ranks": 2}}, "accumulation_steps": 3}}, "x") == {
        "pipeline.data_parallel.zero.hpz_ranks": 2, "pipeline.accumulation_steps": 3}
    with pytest.raises(ValueError, match=r"x: unknown keys \['learning_rate'\]; valid keys: task, task_options"):
        check_keys({"learning_rate": 1e-3}, "x")
    with pytest.raises(ValueError, match=r"x: unknown keys \['lr'\]"):
        check_keys({"lr": 1e-3}, "x")  # a section's field is a key of its table
    with pytest.raises(ValueError, match="batch_size must be int, got '8'"):
        check_keys({"batch_size": "8"}, "x")
    with pytest.raises(ValueError, match="steps must be int, got True"):
        check_keys({"steps": True}, "x")
    with pytest.raises(ValueError, match="task_options must be dict, got 3"):
        check_keys({"task_options": 3}, "x")
    with pytest.raises(ValueError, match=r"unknown keys \['pipeline.data_parallel.zero.stage'\]"):
        check_keys({"pipeline": {"data_parallel": {"zero": {"stage": 1}}}}, "x")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--accumulation-steps", "two"])


def test_config_file_and_flags_override_it(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('ranks = 2\nbatch-size = 16\n[optimizer]\nlr = 1e-3\nwarmup = 5\n'
                    '[pipeline]\nschedule = "1f1b"\naccumulation_steps = 2\n'
                    '[task_options]\nn_layer = 2\nd_model = 16\n'
                    '[pipeline.data_parallel]\nzero_stage = 1\n'
                    '[pipeline.data_parallel.zero]\ntrust_elementwise = true\n')
    values = load_config_file(str(path))
    config = merge_config(values, {"optimizer.lr": 5e-4, "task_options": {"d_model": 32},
                                   "pipeline.accumulation_steps": 4})
    assert (config.pipeline.schedule, config.ranks, config.batch_size, config.optimizer.warmup) == ("1f1b", 2, 16, 5)
    assert config.optimizer.lr == 5e-4  # the flag wins
    assert config.task_options == {"n_layer": 2, "d_model": 32}
    assert config.pipeline.accumulation_steps == 4 and config.pipeline.data_parallel.zero.trust_elementwise
    assert config.pipeline.grad_clip_norm == 1.0, "the run's defaults stay where the file says nothing"
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
    huge = tmp_path / "huge.toml"
    huge.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ValueError, match="huge.toml is .* bytes, over the 1 MiB limit"):
        load_config_file(str(huge))


def test_key_values_are_literals_else_text() -> None:
    assert parse_key_values(["n=3", "lr=1e-3", "name=abc", "on=true"]) == {"n": 3, "lr": 1e-3, "name": "abc",
                                                                          "on": True}
    with pytest.raises(ValueError, match="'3' must look like KEY=VALUE"):
        parse_key_values(["3"])


def test_a_switch_takes_one_word_or_stage_numbers_where_its_field_does() -> None:
    """--activation-checkpointing takes PipelineConfig's values: alone (True), a word, every=k, blocks=i,j, stage
    numbers."""
    for argv, value in ((["--activation-checkpointing"], True), (["--activation-checkpointing", "selective"],
                        "selective"), (["--activation-checkpointing", "every=2"], {"every": 2}),
                        (["--activation-checkpointing", "blocks=0,3"], {"blocks": (0, 3)}),
                        (["--activation-checkpointing", "0", "2"], [0, 2]), (["--no-activation-checkpointing"], False)):
        assert _config(argv).pipeline.activation_checkpointing == value, argv
    with pytest.raises(ValueError, match="activation_checkpointing must be"):
        _config(["--activation-checkpointing", "half"])
    with pytest.raises(ValueError, match="must look like KEY=VALUE"):
        _config(["--compile", "inductor"])  # a switch whose field takes no word
    from_file = merge_config({"pipeline": {"activation_checkpointing": {"every": 3}}}, {})
    assert from_file.pipeline.activation_checkpointing == {"every": 3}
