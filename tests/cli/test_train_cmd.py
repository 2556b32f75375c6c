"""Tests for duplexpipe.cli.train_cmd: `duplexpipe train --schedule FILE` trains a hand-written schedule; a file that
deadlocks, disagrees with the flags or gets generator options is refused in one line before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from duplexpipe.cli import main as cli_main
from duplexpipe.launch import train_loop

SMALL = ["--task-option", "n_layer=2", "--task-option", "d_model=16", "--task-option", "n_head=2", "--task-option",
         "block_size=16", "--batch-size", "4", "--log-every", "0", "--no-tensorboard"]


def _file(path: Path, rank0: str, rank1: str) -> str:
    """A two-rank, two-microbatch schedule written by hand, as a user would."""
    path.write_text('{"format": "duplexpipe-schedule", "version": 1, "name": "mine", "num_ranks": 2, '
                    '"num_microbatches": 2, "stages": [{"rank": 0, "group": 0}, {"rank": 1, "group": 1}], '
                    f'"actions": [{rank0}, {rank1}]}}\n', encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("rank0, rank1, extra, needle", [
    ('["0F0", "0B0", "0F1", "0B1"]', '["1F1", "1B1", "1F0", "1B0"]', [],
     "cannot run: deadlock in 'mine': rank 0 blocked at 0B0 waiting for 1B0 on rank 1; rank 1 blocked at 1F1 "
     "waiting for 0F1 on rank 0; cycle: rank 0: 0B0 -> 0F1 => rank 1"),
    ('["0F0", "0F1", "0B1", "0B0"]', '["1F0", "1F1", "1B1", "1B0"]', ["--ranks", "4"],
     "--ranks 4, but the schedule file mine.json is for 2 ranks; leave --ranks out"),
    ('["0F0", "0F1", "0B1", "0B0"]', '["1F0", "1F1", "1B1", "1B0"]', ["--opt", "chunks=2"],
     "--opt applies to built-in schedules; mine.json is a file"),
    ('["0F0", "0F1", "0B1"]', '["1F0", "1F1", "1B1", "1B0"]', [], "cannot run: "),
])
def test_a_bad_schedule_file_is_one_line_before_any_process(rank0: str, rank1: str, extra: list[str], needle: str,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_loop, "run_training", lambda *_: pytest.fail("a process was started"))
    path = _file(tmp_path / "mine.json", rank0, rank1)
    assert cli_main(["train", "--schedule", Path(path).name, *extra, *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("duplexpipe: error: ") and needle in err and err.count("\n") == 1, err


@pytest.mark.timeout(180)
def test_train_runs_a_hand_written_schedule_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`--schedule mine.json` was "unknown schedule"; the file states 2 ranks and 2 microbatches."""
    monkeypatch.chdir(tmp_path)
    path = _file(tmp_path / "mine.json", '["0F0", "0F1", "0B1", "0B0"]', '["1F0", "1F1", "1B1", "1B0"]')
    assert cli_main(["train", "--schedule", "mine.json", "--steps", "2", "--out-dir", "run", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "mine.json on pp 2 x dp 1 x tp 1 x ep 1 (ZeRO 0, sequence parallel off), 2 steps" in out, out
    assert "tokens/s" in out, out
    assert "0B1" in (tmp_path / "run" / "timeline.json").read_text() and Path(path).is_file()


BEFORE_TORCH: list[tuple[list[str], str]] = [
    (["--steps", "-1"], "steps must be >= 1, got -1"),
    (["--lr", "nan"], "optimizer lr must be a finite number, got nan"),
    (["--zero-stage", "7"], "--zero-stage must be one of 0, 1, 2, 3, got '7'"),
    (["--batch-size", "6", "--dp", "4"], "batch_size 6 is not divisible by dp=4"),
    (["--float8", "bogus"], "PrecisionConfig.float8 must be None, one of ('tensorwise', 'rowwise')"),
    (["--float8", "rowwise(fsdp_all_gather=true)"], "float8 fsdp_all_gather=True needs the 'tensorwise' recipe"),
    (["--ranks", "0"], "ranks must be >= 1, got 0"),
    (["--precision", "fp64"], "--precision must be one of fp32, bf16, fp16, got 'fp64'"),
    (["--grad-clip-norm", "-1"], "grad_clip_norm must be a finite number > 0 or None (no clipping), got -1.0"),
    (["--p2p-compression", "nope"], "unknown p2p_compression 'nope'"),
    (["--p2p-compression", "int8(block=0)"], "Int8BlockCodec block must be an int >= 1, got 0"),
    (["--p2p-compression", "fp8(fmt='e9')"], "unknown fp8 format 'e9'"),
    (["--p2p-compression", "adaptive(ladder=none/zz)"], "adaptive p2p_compression ladder rung 'zz'"),
    (["--activation-checkpointing", "bogus"], "PipelineConfig.activation_checkpointing must be True/False"),
    (["--timeout", "0"], "timeout_s must be > 0, got 0.0"),
    (["--nonfinite-sends", "skip"], "SafetyConfig.nonfinite_sends must be one of ['warn', 'raise'], got 'skip'"),
    (["--dp-strategy", "bogus"], "unknown dp_strategy 'bogus'"),
    (["--grad-bucket-bytes", "0"], "grad_bucket_bytes must be an int >= 1, got 0"),
    (["--grad-compression", "bogus"], "unknown gradient compression 'bogus'"),
    (["--memory-limit", "12XB"], "bad memory size '12XB'"),
    (["--compile", "foo=1"], "PipelineConfig.compile takes torch.compile's options backend, mode, options, dynamic, "
     "fullgraph; got unknown ['foo']"),
    (["--compile", "backend=eager", "mode=max-autotune"], "mode and options are inductor's; backend 'eager' takes "
     "neither"),
    (["--schedule", "nope"], "PipelineConfig.schedule must be a Schedule, a schedule file"),
    (["--schedule", "auto", "--opt", "bogus=1"], "schedule='auto' takes schedule_options"),
    (["--loss-scale-init-scale", "-1"], "init_scale and min_scale must be > 0, got -1.0 and 1.0"),
    (["--microbatches", "0"], "num_microbatches must be an int >= 1 or None, got 0"),
    (["--nonfinite-sends", "raise", "--precision", "fp16"], "SafetyConfig.nonfinite_sends='raise' with "
     "precision='fp16'"),
    (["--schedule", "dualpipe", "--ranks", "2", "--microbatches", "3"],
     "dualpipe needs an even number of microbatches, got num_microbatches=3"),
]
"""Bad flags whose checks need no torch, and a piece of each one's message (naming the value)."""


def test_bad_flags_are_refused_before_torch_is_imported() -> None:
    """Each flag of BEFORE_TORCH: exit 2 and one line naming the value, in a process that never imported torch (the
    flags are parsed and the whole TrainConfig built and checked first; torch takes seconds to import)."""
    import json
    import subprocess
    import sys

    probe = ("import contextlib, io, json, sys\nfrom duplexpipe.cli.main import main\nout = []\n"
             "for flags in json.loads(sys.argv[1]):\n    err = io.StringIO()\n"
             "    with contextlib.redirect_stderr(err):\n        code = main(['train', *flags])\n"
             "    out.append([code, err.getvalue()])\n"
             "torch = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
             "print(json.dumps({'results': out, 'torch': torch}))\n")
    flags = [f for f, _ in BEFORE_TORCH]
    done = subprocess.run([sys.executable, "-c", probe, json.dumps(flags)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for (given, needle), (code, err) in zip(BEFORE_TORCH, found["results"], strict=True):
        assert code == 2, (given, code, err)
        assert err.startswith("duplexpipe: error: ") and err.count("\n") == 1 and needle in err, (given, err)
    assert found["torch"] == [], f"torch was imported: {found['torch'][:3]}"
