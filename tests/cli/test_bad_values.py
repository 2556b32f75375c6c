"""Bad values given to the command line (flags, TOML config files, task options, profiles, input files): each is
refused before any process starts with exit code 2 and one line naming the flag or file and what was expected, never
trained silently, never a traceback. The table is the hostile round's cases; the last test counts them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from duplexpipe.cli import main as cli_main

SMALL = ["--ranks", "2", "--schedule", "1f1b", "--microbatches", "2", "--batch-size", "4", "--steps", "2",
         "--task-option", "n_layer=2", "--task-option", "d_model=16", "--task-option", "n_head=2",
         "--task-option", "block_size=8", "--log-every", "0", "--no-tensorboard"]

CASES: list[tuple[str, list[str], str]] = [
    # silent wrong training
    ("batch-not-divisible-by-dp", ["--dp", "2", "--batch-size", "5"], "batch_size 5 is not divisible by dp=2"),
    ("clip-nan", ["--grad-clip-norm", "nan"], "grad_clip_norm must be a finite number > 0 or None"),
    ("clip-negative", ["--grad-clip-norm", "-1"],
     "grad_clip_norm must be a finite number > 0 or None (no clipping), got -1.0"),
    ("clip-nan-toml", ["--config", "{dir}/clip.toml"], "grad_clip_norm must be a finite number > 0"),
    ("fp16-init-scale-nan", ["--precision", "fp16", "--loss-scale-init-scale", "nan"],
     "LossScaleConfig.init_scale must be a finite number, got nan"),
    ("fp16-init-scale-inf", ["--precision", "fp16", "--loss-scale-init-scale", "inf"],
     "LossScaleConfig.init_scale must be a finite number, got inf"),
    ("fp16-growth-inf", ["--precision", "fp16", "--loss-scale-growth-factor", "inf"],
     "LossScaleConfig.growth_factor must be a finite number, got inf"),
    ("fp16-min-scale-nan", ["--precision", "fp16", "--loss-scale-min-scale", "nan"],
     "LossScaleConfig.min_scale must be a finite number, got nan"),
    # unbounded work
    ("microbatches-and-batch", ["--microbatches", "100000000", "--batch-size", "100000000"],
     "batch_size must be <= 1,048,576 samples per step, got 100,000,000"),
    ("batch-toml", ["--config", "{dir}/huge.toml"], "batch_size must be <= 1,048,576 samples per step"),
    ("microbatches", ["--microbatches", "1000000", "--batch-size", "1000000"],
     "1f1b with P=2 M=1000000: P x M = 2,000,000 is over the command line's limit of 500,000"),
    ("chunks", ["--schedule", "interleaved-1f1b", "--opt", "chunks=100000000"],
     "P x M x chunks = 400,000,000 is over"),
    ("chunks-1e8", ["--schedule", "interleaved-1f1b", "--opt", "chunks=1e8"],
     "interleaved-1f1b needs an integer chunks, got chunks=100000000.0"),
    ("eval-batches", ["--eval-every", "1", "--eval-batches", "100000000"], "eval_batches must be <= 10,000"),
    ("schedule-fifo", ["--schedule", "{dir}/fifo.json"], "fifo.json is a FIFO, not a regular file"),
    ("config-fifo", ["--config", "{dir}/fifo.toml"], "fifo.toml is a FIFO, not a regular file"),
    # raw tracebacks and misleading errors
    ("timeout-inf", ["--timeout", "inf"], "timeout_s must be at most 604,800 seconds (a week), got inf"),
    ("timeout-nan-toml", ["--config", "{dir}/timeout.toml"], "timeout_s must be > 0, got nan"),
    ("compile-timeout-inf", ["--compile-timeout-s", "inf"], "compile_timeout_s must be at most 604,800 seconds"),
    ("seed-2**70", ["--seed", str(2**70)], f"seed must be in 0..{2**63 - 1}"),
    ("n_head=0", ["--task-option", "n_head=0"], "gpt task option n_head must be an int >= 1, got 0"),
    ("d_model=nan", ["--task-option", "d_model=nan"], "gpt task option d_model must be an int >= 1, got 'nan'"),
    ("n_layer=2.5", ["--task-option", "n_layer=2.5"], "gpt task option n_layer must be an int >= 1, got 2.5"),
    ("lr-inf", ["--lr", "inf"], "optimizer lr must be a finite number, got inf"),
    ("weight-decay-inf", ["--weight-decay", "inf"], "optimizer weight_decay must be a finite number, got inf"),
    ("compile-backend", ["--compile-backend", "eager"], "unrecognized arguments: --compile-backend eager"),
    ("ep-on-dense", ["--ep", "2", "--dp", "2", "--batch-size", "8"], "--ep 2: task 'duplexpipe.launch.tasks.gpt:gpt_"
     "task' has no MoE layers"),
    ("zero1-tp-save", ["--zero-stage", "1", "--tp", "2", "--dp", "2", "--batch-size", "8", "--save", "{dir}/ck"],
     "--save with ZeRO-1 under tensor parallelism (--tp 2): its checkpoints are not supported yet"),
    ("accumulation-1.5", ["--config", "{dir}/accumulation.toml"], "pipeline.accumulation_steps must be int, got 1.5"),
    ("checkpointing-yes", ["--activation-checkpointing", "yes"], "activation_checkpointing must be True/False"),
    ("profile-evict-1TiB", ["profile", "--evict", "1TiB"], "argument --evict: 1TiB is over the limit of 4 GiB"),
    ("plan-forward-1e308", ["plan", "--profile", "{dir}/profile.json", "-p", "2", "--batch", "8", "--memory", "1GiB"],
     "field 'forward_s' is 1e+308, over 86,400 seconds"),
]
"""(case, argv after `train` (or a whole command when it starts with one), the first stderr line holds this)."""


def _files(folder: Path) -> None:
    """The files the cases name: TOML configs, FIFOs in place of a schedule and a config, a crafted profile."""
    (folder / "clip.toml").write_text("[pipeline]\ngrad_clip_norm = nan\n")
    (folder / "huge.toml").write_text("batch_size = 100000000\n[pipeline]\nnum_microbatches = 100000000\n")
    (folder / "timeout.toml").write_text("[pipeline.safety]\ntimeout_s = nan\n")
    (folder / "accumulation.toml").write_text("[pipeline]\naccumulation_steps = 1.5\n")
    os.mkfifo(folder / "fifo.json")  # opened to read, a FIFO waits for a writer forever
    os.mkfifo(folder / "fifo.toml")
    part = {"forward_s": 1e308, "backward_input_s": 1e-3, "backward_weight_s": 1e-3, "param_bytes": 1024,
            "activation_bytes": 1024, "input_bytes": 64, "output_bytes": 64}
    (folder / "profile.json").write_text(json.dumps({"format": "duplexpipe-profile", "version": 1,
                                                     "microbatch_size": 1, "parts": [part, part]}))


def _argv(words: list[str], folder: Path) -> list[str]:
    argv = [w.replace("{dir}", str(folder)) for w in words]
    if argv[0] == "--config":  # the file's values alone (flags would override them)
        return ["train", *argv]
    return argv if argv[0] in ("profile", "plan") else ["train", *SMALL, *argv]


def test_each_bad_value_is_one_line_and_exit_2_and_none_trains_or_crashes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case in-process (no process starts: training is replaced by a recorder), and the hostile round's
    counts: 0 silent wrong results (exit 0 or training started), 0 tracebacks (an exception past main)."""
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    trained: list[str] = []
    monkeypatch.setattr("duplexpipe.launch.train_loop.run_training", lambda config: trained.append(config.task))
    wrong: list[str] = []
    silent, crashed = 0, 0
    for case, words, expected in CASES:
        before = len(trained)
        try:
            code = cli_main(_argv(words, tmp_path))
        except Exception as exc:  # noqa: BLE001 - a traceback is what is counted
            crashed += 1
            wrong.append(f"{case}: raised {type(exc).__name__}: {exc}")
            continue
        err = capsys.readouterr().err
        silent += code == 0 or len(trained) > before
        if code != 2 or not err.startswith("duplexpipe: error:") or err.count("\n") != 1 or expected not in err:
            wrong.append(f"{case}: exit {code}, {err!r}")
    assert (silent, crashed) == (0, 0), wrong
    assert not wrong, "\n".join(wrong)
    assert not (tmp_path / "ck").exists()
