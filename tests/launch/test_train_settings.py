"""Tests for duplexpipe.launch.train_settings: every TrainConfig field and every PipelineConfig field a run passes on
is a flag and a config-file key generated from the field (its type, its docstring), so `--help`, the TOML file and
the dataclasses are one list; keys are type-checked, flags override the file, tables build options objects."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import pytest

from duplexpipe.comm.p2p_codecs import Fp8RowCodec, Int8BlockCodec, p2p_codec_pair
from duplexpipe.dp_options.compression import PowerSGDOptions, compression_options
from duplexpipe.fielddoc import field_docs
from duplexpipe.launch.train_config import TrainConfig
from duplexpipe.launch.train_loop import pipeline_config
from duplexpipe.launch.train_settings import (
    HIDDEN,
    INTERNAL,
    add_arguments,
    carried,
    check_keys,
    load_config_file,
    merge_config,
    parse_key_values,
    settings,
    values_from_args,
    writable,
)
from duplexpipe.train.pipeline_config import PipelineConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def _config(argv: list[str], file_values: dict[str, object] | None = None) -> TrainConfig:
    return merge_config(file_values or {}, values_from_args(_parser().parse_args(argv)))


def test_every_config_field_is_a_documented_flag_or_hidden_with_a_reason() -> None:
    """Walk the dataclasses: a new PipelineConfig field is a flag (or a group of flags) as soon as it exists."""
    parser = _parser()
    flags = {a.dest: a for a in parser._actions}  # noqa: SLF001 - the parser's own table of options
    run_docs, pipe_docs = field_docs(TrainConfig), field_docs(PipelineConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in INTERNAL:
            continue
        assert f.name in flags, f"TrainConfig.{f.name} has no flag"
        assert run_docs[f.name] in (flags[f.name].help or "").replace("%%", "%"), f.name  # the field's docstring
    hints = typing.get_type_hints(PipelineConfig)
    for f in dataclasses.fields(PipelineConfig):
        if carried(f.name) is not None or f.name in HIDDEN:
            continue
        assert writable(hints[f.name]), f"PipelineConfig.{f.name}: a type the command line cannot write; list it " \
                                        "in HIDDEN with the reason"
        nested = [k for k in flags if k.startswith(f"{f.name}.")]
        assert f.name in flags or nested, f"PipelineConfig.{f.name} has no flag"
        if f.name in flags:
            assert pipe_docs[f.name] in (flags[f.name].help or "").replace("%%", "%"), f.name
    for name in ("accumulation_steps", "fb_overlap", "zero.hpz_ranks", "loss_scale.init_scale", "schedule_options",
                 "tp", "sequence_parallel", "record_tp_lane"):
        assert name in flags, name
    assert all(reason for reason in HIDDEN.values())
    assert len({s.flags[0] for s in settings()}) == len(settings()), "one flag per setting"
    assert "+11-21% CPU" in " ".join(parser.format_help().split())  # a docstring's % survives argparse


def test_flag_pairs_say_what_the_default_is() -> None:
    """--no-tensorboard's help read 'Write TensorBoard scalars ... (default True)', the opposite of the flag."""
    help_text = _parser().format_help().replace("\n", " ")
    assert "--tensorboard, --no-tensorboard" in help_text and "(default True)" not in help_text
    tensorboard = next(s for s in settings() if s.key == "tensorboard")
    assert tensorboard.help().endswith("(default on)")
    assert _config(["--no-tensorboard"]).tensorboard is False and _config([]).tensorboard is True


def test_pipeline_settings_reach_the_pipeline_config() -> None:
    config = _config(["--accumulation-steps", "2", "--no-fb-overlap", "--zero-hpz-ranks", "2", "--zero-stage", "2",
                      "--dp", "4", "--ep", "2", "--opt", "chunks=2", "--schedule", "interleaved-1f1b", "--ranks", "2",
                      "--loss-scale-init-scale", "1024"])
    assert config.pipeline == {"accumulation_steps": 2, "fb_overlap": False, "zero": {"hpz_ranks": 2},
                               "schedule_options": {"chunks": 2}, "loss_scale": {"init_scale": 1024.0}}
    pcfg = pipeline_config(config)
    assert (pcfg.accumulation_steps, pcfg.fb_overlap, pcfg.zero.hpz_ranks, pcfg.loss_scale.init_scale) == (
        2, False, 2, 1024.0)
    assert config.schedule_object().num_groups == 4 and config.ep == 2  # chunks=2 on 2 ranks
    assert pipeline_config(TrainConfig()) == PipelineConfig(schedule="dualpipe", num_microbatches=8,
                                                            grad_clip_norm=1.0, zero_stage=0)


def test_compression_options_are_written_as_labels() -> None:
    """p2p and gradient compression objects beyond the bare names, as text on the command line and in TOML."""
    config = _config(["--p2p-compression", "int8(block=128), none", "--grad-compression", "powersgd(rank=1)"])
    pcfg = pipeline_config(config)
    act, grad = p2p_codec_pair(pcfg.p2p_compression)
    assert isinstance(act, Int8BlockCodec) and act.block == 128 and grad is None
    assert compression_options(pcfg.grad_compression) == PowerSGDOptions(rank=1)
    act, grad = p2p_codec_pair("fp8")
    assert isinstance(act, Fp8RowCodec) and isinstance(grad, Fp8RowCodec) and (act.fmt, grad.fmt) == ("e4m3", "e5m2")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['size'\]; int8 takes block, stochastic_seed"):
        p2p_codec_pair("int8(size=3)")
    with pytest.raises(ValueError, match=r"p2p_compression must be one of none, bf16, fp8, int8 .*got 'fp4'"):
        TrainConfig(p2p_compression="fp4")
    with pytest.raises(ValueError, match=r"powersgd\(rnk=1\).*unknown option\(s\) \['rnk'\]; it takes rank"):
        compression_options("powersgd(rnk=1)")
    with pytest.raises(ValueError, match="bad options"):
        TrainConfig(grad_compression="powersgd(rank=__import__('os'))")


def test_keys_are_checked_by_name_and_type() -> None:
    assert check_keys({"batch-size": 8, "lr": 1, "grad_clip_norm": 2}, "x") == {
        "batch_size": 8, "lr": 1.0, "grad_clip_norm": 2.0}
    assert check_keys({"zero": {"hpz_ranks": 2}, "accumulation_steps": 3}, "x") == {
        "zero.hpz_ranks": 2, "accumulation_steps": 3}
    with pytest.raises(ValueError, match=r"x: unknown keys \['learning_rate'\]; valid keys: task, task_options"):
        check_keys({"learning_rate": 1e-3}, "x")
    with pytest.raises(ValueError, match="batch_size must be int, got '8'"):
        check_keys({"batch_size": "8"}, "x")
    with pytest.raises(ValueError, match="steps must be int, got True"):
        check_keys({"steps": True}, "x")
    with pytest.raises(ValueError, match="task_options must be dict, got 3"):
        check_keys({"task_options": 3}, "x")
    with pytest.raises(ValueError, match=r"unknown keys \['zero.stage'\]"):
        check_keys({"zero": {"stage": 1}}, "x")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--accumulation-steps", "two"])


def test_config_file_and_flags_override_it(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('schedule = "1f1b"\nranks = 2\nlr = 1e-3\nbatch-size = 16\nwarmup = 5\naccumulation_steps = 2\n'
                    '[task_options]\nn_layer = 2\nd_model = 16\n[zero]\ntrust_elementwise = true\n')
    values = load_config_file(str(path))
    config = merge_config(values, {"lr": 5e-4, "task_options": {"d_model": 32}, "accumulation_steps": 4})
    assert (config.schedule, config.ranks, config.batch_size, config.warmup) == ("1f1b", 2, 16, 5)
    assert config.lr == 5e-4  # the flag wins
    assert config.task_options == {"n_layer": 2, "d_model": 32}
    assert config.pipeline == {"accumulation_steps": 4, "zero": {"trust_elementwise": True}}
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
