"""Tests for duplexpipe.launch.train_loop: task loading, options, a full `duplexpipe train` run (2 pp x 2 dp)
with a config file, metrics and checkpoints, an exact resume, and the wheel holding the default task."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from duplexpipe.cli import main as cli_main
from duplexpipe.cli.train_cmd import add_train_arguments, config_from_args, train_main
from duplexpipe.launch.metrics import read_metrics
from duplexpipe.launch.train_config import lr_factor
from duplexpipe.launch.train_loop import DEFAULT_TASK, TrainConfig, checkpoint_to_load
from duplexpipe.launch.train_task import build_task, load_task
from duplexpipe.schedules.timeline import Timeline

ROOT = Path(__file__).resolve().parents[2]
SMALL = '[task_options]\nn_layer = 2\nd_model = 16\nn_head = 2\nblock_size = 16\n'


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return parser.parse_args(argv)


def test_load_task_resolves_modules_and_files(tmp_path: Path) -> None:
    assert DEFAULT_TASK == "duplexpipe.launch.tasks.gpt:gpt_task"
    assert load_task(DEFAULT_TASK).__name__ == "gpt_task"
    assert load_task("json:dumps") is json.dumps
    script = tmp_path / "my_task.py"
    script.write_text("def make(seed, width=3):\n    return (seed, width)\n")
    assert load_task(f"{script}:make")(seed=1) == (1, 3)
    with pytest.raises(ValueError, match="must look like"):
        load_task("no_colon")
    with pytest.raises(ValueError, match="does not exist"):
        load_task("missing_file.py:f")
    with pytest.raises(ValueError, match="json has no function 'nope'"):
        load_task("json:nope")
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        load_task("no_such_module:f")
    with pytest.raises(TypeError, match="returned a tuple, not a TrainTask"):
        build_task(TrainConfig(task=f"{script}:make"))


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('ranks = 2\nsteps = 9\n[optimizer]\nlr = 0.01\n[pipeline]\nschedule = "1f1b"\n' + SMALL)
    config = config_from_args(_parse(["--config", str(path), "--lr", "0.002", "--task-option", "n_layer=4",
                                      "--no-tensorboard", "--timeout", "30"]))
    assert (config.pipeline.schedule, config.ranks, config.steps, config.optimizer.lr) == ("1f1b", 2, 9, 0.002)
    assert config.task_options == {"n_layer": 4, "d_model": 16, "n_head": 2, "block_size": 16}
    assert (config.metrics.tensorboard, config.pipeline.safety.timeout_s) == (False, 30.0)
    assert config_from_args(_parse([])) == TrainConfig()


def test_parallelism_flags_reach_the_pipeline_config() -> None:
    config = config_from_args(_parse(["--grad-compression", "int8", "--zero-stage", "1", "--keep", "3",
                                      "--task", "hf", "--save-pretrained", "out"]))
    dp = config.pipeline.data_parallel
    assert (dp.grad_compression, dp.zero_stage, config.checkpoint.keep, config.checkpoint.save_pretrained) == (
        "int8", 1, 3, "out")
    assert config.task == "duplexpipe.launch.tasks.hf:hf_task"
    auto = config_from_args(_parse(["--schedule", "auto", "--memory-limit", "2GiB"])).pipeline
    assert (auto.schedule, auto.memory_limit, TrainConfig().pipeline.data_parallel.grad_compression) == (
        "auto", "2GiB", None)
    tensor = config_from_args(_parse(["--tp", "2", "--sequence-parallel"]))
    assert (tensor.tp, tensor.pipeline.sequence_parallel) == (2, True)
    with pytest.raises(SystemExit):
        _parse(["--zero-stage", "4"])


def test_p2p_compression_flag_reaches_the_pipeline_config() -> None:
    config = config_from_args(_parse(["--p2p-compression", "int8"]))
    assert config.pipeline.precision.p2p_compression == "int8"
    assert TrainConfig().pipeline.precision.p2p_compression is None, "sends as computed"
    assert config_from_args(_parse(["--p2p-compression", "none"])).pipeline.precision.p2p_compression == "none"
    with pytest.raises(ValueError, match=r"unknown p2p_compression 'fp4'; expected None, one of \['bf16', 'fp8'"):
        config_from_args(_parse(["--p2p-compression", "fp4"]))  # a label with options is no argparse choice


def test_compile_flags_reach_the_pipeline_config() -> None:
    assert TrainConfig().pipeline.compile is False
    config = config_from_args(_parse(["--compile", "backend=aot_eager"]))
    assert config.pipeline.compile == {"backend": "aot_eager"}
    assert config_from_args(_parse(["--compile"])).pipeline.compile is True  # torch's defaults: inductor
    assert config_from_args(_parse(["--compile", "--no-compile"])).pipeline.compile is False


@pytest.mark.parametrize("argv, message", [
    (["--config", "missing.toml"], "config file missing.toml: cannot read it"),
    (["--batch-size", "0"], "batch_size must be >= 1, got 0"),
    (["--schedule", "dualpipe", "--ranks", "3"], "dualpipe"),
    (["--task", "no_such_module:f"], "cannot import no_such_module"),
    (["--resume", "nowhere"], "resume: nowhere holds no checkpoint"),
    (["--memory-limit", "1GiB"], "memory_limit is for schedule='auto' (the planner's cap)"),
    (["--compile", "backend=nope"], "torch.compile rejects it: Invalid backend: 'nope'"),
    (["--grad-compression", "powersgd", "--zero-stage", "1"], "'powersgd' cannot be combined with ZeRO"),
    (["--schedule", "auto", "--memory-limit", "lots"], "bad memory size 'lots'"),
    (["--profile-steps", "3:2"], "profile_steps must be A:B, steps 1 <= A <= B (e.g. 3:5), got '3:2'"),
    (["--profile-steps", "5:80"], "profile_steps '5:80' ends after the run's 60 steps"),
    (["--wandb", "projekt=x"], "--wandb: wandb.init takes no option(s) projekt"),
    (["--save-pretrained", "hf-out"], "--save-pretrained writes a Hugging Face model; the gpt task trains none"),
    (["--task", "hf"], "task hf needs --task-option model=DIR"),
    (["--task", "hf", "--task-option", "model=nowhere", "--task-option", "data=x"], "nowhere is not a model directory"),
    (["--task", "hf", "--task-option", "model=bert", "--task-option", "data=x"], "model_type 'bert' is not supported"),
])
def test_bad_train_input_is_one_line_and_exit_2(argv: list[str], message: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert cli_main(["train", *argv, "--save", "ckpt", "--out-dir", "out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("duplexpipe: error:") and message in err and err.count("\n") == 1, err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before, "nothing on disk changed"


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps of 1F1B on 2 ranks x 2 replicas from a config file; checkpoints after steps 2 and 4."""
    root = tmp_path_factory.mktemp("train")
    (root / "run.toml").write_text('ranks = 2\ndp = 2\nsteps = 4\nbatch_size = 8\nbalance = "time"\n'
                                   '[optimizer]\nwarmup = 1\nlr_schedule = "cosine"\n'
                                   '[checkpoint]\nsave_every = 2\n[metrics]\nlog_every = 0\ntimeline_every = 2\n'
                                   '[pipeline]\nschedule = "1f1b"\nnum_microbatches = 2\n'
                                   '[pipeline.precision]\np2p_compression = "bf16"\n' + SMALL)
    args = _parse(["--config", str(root / "run.toml"), "--out-dir", str(root / "a"), "--save", str(root / "ckpt")])
    out = io.StringIO()
    assert train_main(args, out) == 0
    (root / "summary.txt").write_text(out.getvalue())
    return root


@pytest.mark.timeout(300)
def test_train_writes_metrics_outputs_and_checkpoints(straight_run: Path) -> None:
    root = straight_run
    text = (root / "summary.txt").read_text()
    assert "1f1b on pp 2 x dp 2 x tp 1 x ep 1 (ZeRO 0, sequence parallel off), 4 steps" in text
    assert "partition (time" in text
    # rank 0 sends activations of 2 rows x 16 tokens x d_model 16 per microbatch, as bf16 (2 bytes)
    assert "stage-to-stage sends (bf16): 1,024 bytes each on rank 0" in text
    rows = read_metrics(root / "a" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert set(rows[0]) == {"step", "loss", "lr", "grad_norm", "items_per_s", "bubble"}
    factor = lr_factor("cosine", 1, 4, TrainConfig().optimizer.min_lr_ratio)
    assert [r["lr"] for r in rows] == pytest.approx([TrainConfig().optimizer.lr * factor(s) for s in range(4)])
    assert all(r["grad_norm"] > 0 and r["items_per_s"] > 0 and 0 <= r["bubble"] < 1 for r in rows)
    summary = json.loads((root / "a" / "losses.json").read_text())
    assert summary["losses"] == [r["loss"] for r in rows] and summary["config"]["batch_size"] == 8
    timeline = Timeline.from_dict(json.loads((root / "a" / "timeline.json").read_text()))
    assert timeline.num_ranks == 2 and len(timeline.events) == 2 * 2 * 2  # ranks x microbatches x (F, B)
    # the step's bubble comes from a tensor all-gather of (start, end, busy) per rank: the gathered timeline's figure
    assert rows[-1]["bubble"] == pytest.approx(timeline.bubble_ratio, abs=1e-9)
    # full timelines are gathered only every timeline_every (2) steps, when asked
    assert sorted(p.name for p in (root / "a" / "timelines").iterdir()) == ["step-000002.json", "step-000004.json"]
    assert Timeline.from_dict(json.loads((root / "a" / "timelines" / "step-000004.json").read_text())) == timeline
    assert "est. time" in (root / "a" / "partition.txt").read_text()
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["latest", "step-000002", "step-000004"]
    assert checkpoint_to_load(str(root / "ckpt")) == str(root / "ckpt" / "step-000004")


@pytest.mark.timeout(300)
def test_resume_repeats_the_uninterrupted_steps_exactly(straight_run: Path) -> None:
    root = straight_run
    checkpoint = root / "ckpt" / "step-000002"
    proc = subprocess.run([sys.executable, "-m", "duplexpipe.cli", "train", "--config", str(root / "run.toml"),
                           "--out-dir", str(root / "b"), "--resume", str(checkpoint)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resuming from step 2 of {checkpoint}\n" in proc.stdout and "steps 3-4" in proc.stdout, proc.stdout
    straight = read_metrics(root / "a" / "metrics.jsonl")[2:]
    resumed = read_metrics(root / "b" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "lr", "grad_norm"):  # weights, optimizer, LR schedule and data all continue exactly
        assert [r[key] for r in resumed] == [r[key] for r in straight], key


@pytest.mark.timeout(300)
def test_a_checkpoint_of_another_model_is_exit_2_and_changes_nothing(straight_run: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    root = straight_run
    before = sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*"))
    args = ["train", "--config", str(root / "run.toml"), "--task-option", "n_layer=3", "--out-dir",
            str(root / "c"), "--resume", str(root / "ckpt"), "--steps", "6"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match this model" in err[0] and "model.layer2.attn.k.bias" in err[0], err
    assert sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*")) == before


@pytest.mark.timeout(300)
def test_train_with_tensor_and_sequence_parallelism(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text('ranks = 2\ntp = 2\nsteps = 2\nbatch_size = 8\n[metrics]\nlog_every = 0\n'
                                       '[pipeline]\nschedule = "1f1b"\nsequence_parallel = true\n'
                                       'num_microbatches = 2\n' + SMALL)
    out = io.StringIO()
    assert train_main(_parse(["--config", str(tmp_path / "run.toml"), "--out-dir", str(tmp_path / "a")]), out) == 0
    text = out.getvalue()
    assert "1f1b on pp 2 x dp 1 x tp 2 x ep 1 (ZeRO 0, sequence parallel on), 2 steps" in text
    # each TP rank sends its half of the sequence: 4 rows x 8 of 16 tokens x d_model 16, float32
    assert "stage-to-stage sends (none): 2,048 bytes each on rank 0" in text
    assert len(read_metrics(tmp_path / "a" / "metrics.jsonl")) == 2


@pytest.mark.timeout(240)
def test_the_wheel_contains_the_default_task_and_its_corpus(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=200)
    (wheel,) = tmp_path.glob("duplexpipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("duplexpipe/launch/tasks/gpt.py", "duplexpipe/launch/tasks/hf.py",
                 "duplexpipe/launch/tasks/data/kjv_genesis_exodus.txt",
                 "duplexpipe/launch/tasks/data/README.md", "duplexpipe/py.typed"):
        assert name in names
    assert not any(n.startswith("examples/") for n in names)


@pytest.mark.timeout(300)
def test_steps_count_optimizer_steps_and_a_layout_change_is_one_line(tmp_path: Path) -> None:
    """`duplexpipe train --steps 2 --accumulation-steps 2`: two optimizer steps of two batches each, everywhere a
    step is counted (the log, metrics.jsonl, losses.json, the checkpoint's name, the summary); resumed with
    --steps 3 on another layout, it makes step 3 and says what the layout change reset in one log line."""
    from duplexpipe.train.checkpoint import read_checkpoint

    (tmp_path / "run.toml").write_text(SMALL)

    def train(ranks: int, steps: int) -> subprocess.CompletedProcess[str]:
        argv = ["--config", str(tmp_path / "run.toml"), "--schedule", "1f1b", "--ranks", str(ranks), "--microbatches",
                str(ranks), "--batch-size", "2", "--steps", str(steps), "--accumulation-steps", "2", "--log-every",
                "1", "--no-tensorboard", "--out-dir", str(tmp_path / "out"), "--save", str(tmp_path / "ckpt")]
        done = subprocess.run([sys.executable, "-m", "duplexpipe.cli", "train", *argv], capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    out = train(ranks=1, steps=2).stdout
    assert "1f1b on pp 1 x dp 1 x tp 1 x ep 1 (ZeRO 0, sequence parallel off), 2 steps of 2 batches: loss" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1/2", "2/2"]
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] is not None for r in rows), "every step ends an accumulation window"
    assert len(json.loads((tmp_path / "out" / "losses.json").read_text())["losses"]) == 2
    checkpoint = tmp_path / "ckpt" / "step-000002"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", checkpoint.name]
    saved = read_checkpoint(str(checkpoint))
    assert (saved["trainer.calls"], saved["trainer.optimizer_steps"]) == (4, 2)

    resumed = train(ranks=2, steps=3)  # from step 2, on 2 pipeline ranks
    lines = resumed.stdout.splitlines()
    at = lines.index(f"resuming from step 2 of {checkpoint}")
    assert lines[at + 1].startswith(f"warning: checkpoint {checkpoint} was saved with another layout ("), lines
    assert "Warning" not in resumed.stderr and ".py:" not in resumed.stderr, resumed.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3]


NAN_WEIGHT_TASK = '''
import torch
from duplexpipe.launch.tasks.gpt import gpt_task
from duplexpipe.launch.train_task import TrainTask

def task(seed: int = 0) -> TrainTask:
    made = gpt_task(n_layer=1, d_model=8, n_head=2, block_size=8, seed=seed)
    with torch.no_grad():
        next(made.layers[0].parameters()).fill_(float("nan"))  # every gradient is NaN, every step skipped
    return made
'''


def test_a_run_whose_every_step_is_skipped_says_so_and_exits_non_zero(tmp_path: Path) -> None:
    """fp16 skips a NaN step whatever nonfinite_grads says: each skip prints its line, and a run that skipped them
    all (it trained nothing) fails naming why (a process of its own: the ranks' own output is checked)."""
    (tmp_path / "nan_task.py").write_text(NAN_WEIGHT_TASK)
    argv = ["train", "--task", f"{tmp_path / 'nan_task.py'}:task", "--ranks", "1", "--schedule", "1f1b",
            "--microbatches", "1", "--batch-size", "2", "--steps", "2", "--log-every", "0", "--no-tensorboard",
            "--precision", "fp16", "--nonfinite-grads", "raise"]
    done = subprocess.run([sys.executable, "-m", "duplexpipe.cli", *argv], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 1, done.stderr[-2000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines() if "skipped" in line] == [
        "step 1/2 skipped", "step 2/2 skipped"], done.stdout
    assert "EveryStepSkipped: every optimizer step of steps 1-2 was skipped" in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr, done.stderr


def test_resuming_refuses_optimizer_settings_the_checkpoint_overrides() -> None:
    """The checkpoint's lr (its param groups) is what a resumed optimizer uses: another --lr is refused, not
    recorded while the checkpoint's trains; the same one passes."""
    import torch

    from duplexpipe.launch.train_config import OptimizerConfig, TrainConfig
    from duplexpipe.launch.train_loop import check_resumed_optimizer

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.003, momentum=0.9, weight_decay=0.01)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)  # the group's lr now differs from initial_lr
    same = TrainConfig(optimizer=OptimizerConfig(name="sgd", lr=0.003, momentum=0.9, weight_decay=0.01))
    check_resumed_optimizer(optimizer, same, "run/step-000002")
    for flag, changed in (("--lr 0.5", {"lr": 0.5}), ("--momentum 0.5", {"momentum": 0.5}),
                          ("--weight-decay 0", {"weight_decay": 0.0})):
        config = TrainConfig(optimizer=OptimizerConfig(**{"name": "sgd", "lr": 0.003, "momentum": 0.9,
                                                          "weight_decay": 0.01, **changed}))
        with pytest.raises(ValueError, match=f"{flag}, but the checkpoint run/step-000002 was trained with"):
            check_resumed_optimizer(optimizer, config, "run/step-000002")
