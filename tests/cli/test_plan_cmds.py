"""`duplexpipe plan`, `duplexpipe profile` and `--profile` on simulate/compare; bad input exits 2 with one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from duplexpipe.cli import main
from duplexpipe.planner.profile import PartProfile, Profile, TPFacts, load_profile, save_profile

MIB = 2**20
TASK = '''
import torch
from torch import nn
from duplexpipe.launch.train_task import TrainTask

def task(width=8):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(4)]
    data = torch.randn(6, width)
    return TrainTask(layers=layers, loss_fn=nn.functional.mse_loss,
                     batch=lambda step, size: (data[:size], data[:size]))
'''


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def profile_file(tmp_path: Path) -> str:
    parts = tuple(PartProfile(1e-3, 1e-3, 1e-3, MIB, 8 * MIB, 64 * 1024, 64 * 1024) for _ in range(4))
    path = tmp_path / "profile.json"
    save_profile(Profile(parts, 4), path)
    return str(path)


def test_plan_prints_a_ranked_table_and_the_best_plan(capsys: pytest.CaptureFixture[str], profile_file: str) -> None:
    code, out, err = run(capsys, "plan", "--profile", profile_file, "-p", "2", "--batch", "16", "--memory", "80MiB")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("plan for P=2 x D=1 x T=1, batch 16, cap 80 MiB per rank")
    assert lines[1].split()[:3] == ["schedule", "M", "ZeRO"]
    assert any(line.startswith("best: ") for line in lines)
    assert "> cap 80 MiB" in out


def test_plan_json_and_pareto_plot(capsys: pytest.CaptureFixture[str], profile_file: str, tmp_path: Path) -> None:
    figure = tmp_path / "pareto.png"
    code, out, err = run(capsys, "plan", "--profile", profile_file, "-p", "2", "--dp", "2", "--batch", "16",
                         "--memory", "200MiB", "--bandwidth", "10GB", "--zero", "0,1", "--compression", "all",
                         "--json", "--plot", str(figure))
    assert code == 0, err
    data = json.loads(out)
    assert data["ranks"] == 2 and data["dp"] == 2 and data["memory_bytes"] == 200 * MIB
    assert {c["zero"] for c in data["candidates"]} == {0, 1}
    assert data["best"]["step_s"] > 0 and data["advice"]
    assert figure.stat().st_size > 1000


def test_plan_shows_each_plan_once_and_only_what_the_trainer_runs(capsys: pytest.CaptureFixture[str],
                                                                  profile_file: str) -> None:
    base = ("plan", "--profile", profile_file, "-p", "2", "--batch", "16", "--memory", "200MiB", "--json")
    code, out, err = run(capsys, *base)
    assert code == 0, err
    rows = json.loads(out)["candidates"]
    assert {c["zero"] for c in rows} == {0}, "with D = 1 the ZeRO stages are one plan"
    assert len(rows) == len({(c["schedule"], c["microbatches"]) for c in rows})
    code, out, err = run(capsys, *base, "--dp", "2", "--bandwidth", "1MB", "--compression", "all")
    assert code == 0, err
    rows = [c for c in json.loads(out)["candidates"] if not c["rejected"]]
    assert {c["zero"] for c in rows} == {0, 1, 2}
    assert not {c["compression"] for c in rows if c["zero"]} & {"powersgd", "powersgd(rank=1)", "dgc"}
    code, out, err = run(capsys, *base[:-1], "--dp", "2", "--zero", "1", "--compression", "powersgd")
    assert code == 2 and "the trainer refuses ZeRO 1 with every allowed compression" in err
    assert len(err.strip().splitlines()) == 1


def test_plan_with_shared_cores(capsys: pytest.CaptureFixture[str], profile_file: str) -> None:
    args = ("plan", "--profile", profile_file, "-p", "4", "--batch", "32", "--memory", "1GiB", "--schedules",
            "1f1b", "--microbatches", "8", "--json")
    steps = []
    for extra in ((), ("--cores", "4"), ("--cores", "1")):
        code, out, err = run(capsys, *args, *extra)
        assert code == 0, err
        steps.append(json.loads(out)["best"]["step_s"])
    assert steps[0] == steps[1] < steps[2]  # 4 cores for 4 ranks: as a device per rank; 1 core: serialized
    code, out, _ = run(capsys, *args[:-1], "--cores", "2")
    assert code == 0 and "2 cores shared by the ranks, no runtime overhead measured" in out
    code, _, err = run(capsys, *args, "--cores", "0")
    assert code == 2 and "cores must be >= 1, got 0" in err and len(err.strip().splitlines()) == 1


def test_plan_header_names_the_measured_compute_scale(capsys: pytest.CaptureFixture[str], profile_file: str,
                                                       tmp_path: Path) -> None:
    data = json.loads(Path(profile_file).read_text())
    data["overhead"] = {"action_s": 1e-4, "message_s": 2e-4, "step_s": 1e-3, "compute_scale": 1.25}
    scaled = tmp_path / "scaled.json"
    scaled.write_text(json.dumps(data))
    code, out, err = run(capsys, "plan", "--profile", str(scaled), "-p", "4", "--batch", "32", "--memory", "1GiB",
                         "--schedules", "1f1b", "--microbatches", "8", "--cores", "2")
    assert code == 0, err
    assert "100 us per action, 200 us per message, 1 ms per step, compute x 1.25 in the pipeline" in out


@pytest.mark.parametrize(("args", "needle"), [
    (["--memory", "4Gx"], "bad memory size '4Gx'"),
    (["--memory", "1KiB"], "the smallest feasible cap is"),
    (["-p", "8"], "the profile has 4 parts, but 8 ranks need at least 8"),
    (["--schedules", "nope"], "unknown schedule 'nope'"),
    (["--zero", "1,x"], "zero must be an integer, got 'x'"),
    (["--bandwidth", "fast"], "bad memory size 'fast'"),
])
def test_plan_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], profile_file: str,
                                               args: list[str], needle: str) -> None:
    base = {"-p": "2", "--batch": "16", "--memory": "80MiB"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = ["plan", "--profile", profile_file] + [x for kv in base.items() for x in kv]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_plan_rejects_a_malformed_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "duplexpipe-profile", "version": 1, "microbatch_size": 2,
                               "parts": [{"forward_s": 1}]}), encoding="utf-8")
    code, _, err = run(capsys, "plan", "--profile", str(bad), "-p", "1", "--batch", "4", "--memory", "1GiB")
    assert code == 2 and "parts[0]: missing field 'backward_input_s'" in err and len(err.splitlines()) == 1
    code, _, err = run(capsys, "plan", "--profile", str(tmp_path / "none.json"), "-p", "1", "--batch", "4",
                       "--memory", "1GiB")
    assert code == 2 and "cannot read profile" in err


def test_simulate_and_compare_show_bytes_with_a_profile(capsys: pytest.CaptureFixture[str],
                                                        profile_file: str) -> None:
    code, out, err = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--profile", profile_file, "--json")
    assert code == 0, err
    memory = json.loads(out)["memory"]
    assert [r["rank"] for r in memory] == [0, 1, 2, 3] and memory[0]["activations"] == 4 * MIB
    assert memory[0]["peak"] > memory[0]["params"] * 4  # params + grads + AdamW states + activations
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--profile", profile_file)
    assert code == 0 and "memory per rank" in out and "4 MiB" in out
    code, out, err = run(capsys, "compare", "-p", "2", "-m", "4", "--profile", profile_file, "--json")
    assert code == 0, err
    rows = {r["schedule"]: r for r in json.loads(out)["schedules"]}
    assert rows["1f1b"]["peak_bytes"] > 0 and rows["zbv"]["peak_bytes"] > 0 and rows["auto"]["peak_bytes"] > 0
    code, out, err = run(capsys, "compare", "-p", "4", "-m", "8", "--profile", profile_file, "--json")
    rows = {r["schedule"]: r for r in json.loads(out)["schedules"]}
    assert "at least 8" in rows["zbv"]["peak_bytes_error"] and rows["zb-h1"]["peak_bytes"] > 0
    code, _, err = run(capsys, "simulate", "zbv", "-p", "4", "-m", "8", "--profile", profile_file)
    assert code == 2 and "profile has 4 parts; 8 model parts need" in err


def test_profile_command_writes_a_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    task = tmp_path / "tiny_task.py"
    task.write_text(TASK, encoding="utf-8")
    out_file = tmp_path / "p.json"
    code, out, err = run(capsys, "profile", "--task", f"{task}:task", "--parts", "2", "--microbatch", "2",
                         "--repeats", "1", "-o", str(out_file))
    assert code == 0, err
    profile = load_profile(out_file)
    assert profile.num_parts == 2 and profile.microbatch_size == 2
    assert profile.parts[0].param_bytes == 2 * (8 * 8 + 8) * 4 and "profile written to" in out
    assert profile.parts[0].fixed is not None and profile.parts[0].backward_fused_s is not None  # affine, fused B
    code, _, err = run(capsys, "profile", "--task", f"{task}:task", "--parts", "2", "--microbatch", "2",
                       "--repeats", "1", "--evict", "64KiB", "-o", str(out_file))
    assert code == 0, err
    assert load_profile(out_file).meta["evict_bytes"] == 64 * 1024
    code, _, err = run(capsys, "profile", "--task", f"{task}:task", "--parts", "2", "--evict", "lots", "-o",
                       str(out_file))
    assert code == 2 and "lots" in err
    code, _, err = run(capsys, "profile", "--task", f"{task}:task", "--parts", "5", "-o", str(out_file))
    assert code == 2 and "cannot split 4 layers into 5 model parts" in err
    code, _, err = run(capsys, "profile", "--task", f"{task}:task", "--parts", "2", "--microbatch", "9",
                       "-o", str(out_file))
    assert code == 2 and "--microbatch 9: the task's batch(0, 9) gave only 6 samples" in err


@pytest.mark.timeout(240)
def test_a_calibrated_profile_carries_the_runtime_overhead_into_plan(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    """plan ranked an MoE case in the wrong order, 2.7x low, saying "no runtime overhead measured" in small print:
    profile --calibrate measures it as schedule='auto' does, and plan says loudly when a profile lacks it."""
    task = tmp_path / "tiny_task.py"
    task.write_text(TASK, encoding="utf-8")
    calibrated, plain = tmp_path / "calibrated.json", tmp_path / "plain.json"
    code, out, err = run(capsys, "profile", "--task", f"{task}:task", "--parts", "4", "--repeats", "1", "--calibrate",
                         "--ranks", "2", "--batch", "4", "--budget", "0.5", "-o", str(calibrated))
    assert code == 0, err
    profile = load_profile(calibrated)
    assert profile.microbatch_size == 2  # the largest candidate
    assert f"calibrated on 2 ranks sharing {len(os.sched_getaffinity(0))} cores (plan's default), batch 4" in out
    assert profile.meta["calibrated_on"] == {"ranks": 2, "batch": 4} and profile.meta["calibration_walls"]
    cores = len(os.sched_getaffinity(0))
    assert profile.meta["calibration_mesh"] == {"ranks": 2, "batch": 4, "cores": cores}  # what plan defaults to
    assert [name for name, _, _ in profile.meta["calibration_walls"]] == ["gpipe", "gpipe", "zb-h1",
                                                                           "interleaved-1f1b"]  # 4 parts on 2 ranks
    plan_args = ("-p", "2", "--batch", "4", "--memory", "1GiB", "--schedules", "1f1b,gpipe")
    if profile.overhead is not None:  # the solver separated its terms (it may not on a disturbed machine)
        code, out, err = run(capsys, "plan", "--profile", str(calibrated), *plan_args)
        head = out.splitlines()[0]
        assert code == 0 and "runtime overhead" in head and "warning" not in err, (out, err)
        assert f"{cores} cores shared by the ranks, as calibrated; their runs got" in head, head
    assert run(capsys, "profile", "--task", f"{task}:task", "--parts", "4", "--repeats", "1", "-o", str(plain))[0] == 0
    code, out, err = run(capsys, "plan", "--profile", str(plain), *plan_args)
    assert code == 0 and err.startswith("warning: this profile holds no runtime overhead") and "--calibrate" in err
    code, _, err = run(capsys, "profile", "--task", f"{task}:task", "--parts", "4", "--batch", "4", "-o", str(plain))
    assert code == 2 and "--batch: only with --calibrate" in err


@pytest.fixture()
def tp_profile_file(tmp_path: Path) -> str:
    facts = TPFacts(2, 2 * 64 * 1024, 4, 4 * 64 * 1024, MIB)
    parts = tuple(PartProfile(4e-3, 4e-3, 4e-3, MIB, 8 * MIB, 64 * 1024, 64 * 1024, tp=facts) for _ in range(4))
    path = tmp_path / "tp_profile.json"
    save_profile(Profile(parts, 4, tp_degrees=(2, 4)), path)
    return str(path)


def test_plan_world_compares_every_mesh_and_shows_the_tp_degree(capsys: pytest.CaptureFixture[str],
                                                               tp_profile_file: str) -> None:
    base = ("plan", "--profile", tp_profile_file, "--world", "4", "--batch", "16", "--memory", "1GiB",
            "--schedules", "1f1b")
    code, out, err = run(capsys, *base, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["world"] == 4 and data["tp_bandwidth"] == 300e9
    assert {(c["pp"], c["dp"], c["tp"]) for c in data["candidates"]} == {
        (1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)}
    assert (data["best"]["pp"], data["best"]["dp"], data["best"]["tp"]) == (data["ranks"], data["dp"], data["tp"])
    code, out, err = run(capsys, *base, "--tp", "2", "--tp-bandwidth", "1GB", "--tp-latency", "1e-4")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("plan for world 4 (every P x D x T)") and "TP link 1 GB/s" in lines[0]
    assert lines[1].split()[:5] == ["schedule", "M", "ZeRO", "compression", "PxDxT"]
    assert {line.split()[4] for line in lines[2:] if line.startswith("1f1b ")} == {"1x2x2", "2x1x2"}
    assert any(line.startswith("best: ") and "x T=2: step" in line for line in lines)
    steps = []
    for bandwidth in ("1TB", "1GB", "10MB"):  # one mesh: -p 2 --tp 2
        code, out, err = run(capsys, "plan", "--profile", tp_profile_file, "-p", "2", "--tp", "2", "--batch", "16",
                             "--memory", "1GiB", "--schedules", "1f1b", "--microbatches", "8", "--tp-bandwidth",
                             bandwidth, "--sequence-parallel", "--json")
        assert code == 0, err
        steps.append(json.loads(out)["best"]["step_s"])
    assert steps == sorted(steps) and len(set(steps)) == 3


@pytest.mark.parametrize(("args", "needle"), [
    (["--world", "6", "--tp", "4"], "world 6 does not factor as P x D x T with tp=4"),
    (["--world", "4", "-p", "3"], "world 4 does not factor as P x D x T with pp=3"),
    (["--world", "0"], "world must be >= 1, got 0"),
    (["--world", "4", "--tp-bandwidth", "0"], "bad memory size '0': must be > 0"),
    (["--world", "4", "--tp-bandwidth", "fast"], "bad memory size 'fast'"),
    (["--world", "4", "--tp-latency", "-1"], "tp-latency must be >= 0 seconds"),
    (["--tp", "0", "-p", "2"], "tp must be >= 1, got 0"),
    (["--world", "3", "--tp", "3"], "the TP plan cannot shard the model at tp=3 (degrees it can: 2, 4)"),
    (["--batch", "16"], "plan needs -p/--ranks P (one mesh) or --world N"),
])
def test_plan_world_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tp_profile_file: str,
                                                     args: list[str], needle: str) -> None:
    code, out, err = run(capsys, "plan", "--profile", tp_profile_file, "--batch", "16", "--memory", "1GiB", *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_plan_at_tp_needs_a_profile_with_tp_facts(capsys: pytest.CaptureFixture[str], profile_file: str) -> None:
    code, _, err = run(capsys, "plan", "--profile", profile_file, "-p", "2", "--tp", "2", "--batch", "16",
                       "--memory", "1GiB")
    assert code == 2 and "tp=2: the profile has no tensor-parallel facts" in err
    code, out, err = run(capsys, "plan", "--profile", profile_file, "--world", "4", "--batch", "16", "--memory",
                         "1GiB", "--json")  # the TP meshes are rejected rows, the others planned
    assert code == 0, err
    data = json.loads(out)
    assert data["best"]["tp"] == 1
    assert all("no tensor-parallel facts" in c["rejected"] for c in data["candidates"] if c["tp"] > 1)


def test_profile_command_records_the_tasks_tp_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "gpt.json"
    code, out, err = run(capsys, "profile", "--task-option", "n_layer=2", "--task-option", "d_model=16",
                         "--parts", "2", "--microbatch", "2", "--repeats", "1", "-o", str(out_file))
    assert code == 0, err
    profile = load_profile(out_file)
    assert profile.tp_degrees == (2, 4) and "tensor-parallel degrees the plan can shard: 2, 4" in out  # 4 heads
    first = profile.parts[0].tp
    assert first is not None and first.forward_collectives == 2 and first.backward_collectives == 4
    assert first.forward_bytes == 2 * 2 * 64 * 16 * 4  # two row-parallel outputs of (2, 64, 16) float32


def test_plan_with_a_memory_limit_only_a_lever_meets_says_which_constraint_decided(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    parts = tuple(PartProfile(1e-3, 1e-3, 1e-3, MIB, 64 * MIB, 64 * 1024, 64 * 1024) for _ in range(4))
    path = tmp_path / "heavy.json"
    save_profile(Profile(parts, 4), path)
    args = ("plan", "--profile", str(path), "-p", "2", "--dp", "4", "--batch", "32", "--schedules", "zbv",
            "--microbatches", "4", "--bandwidth", "1GB", "--zero", "2,3", "--activation-checkpointing", "off")
    code, out, err = run(capsys, *args, "--memory-limit", "400MiB", "--json")
    assert code == 0, err
    zero2 = json.loads(out)["best"]
    assert zero2["zero"] == 2 and zero2["reshard_window"] is None
    cap = int(zero2["peak_bytes"]) - 8 * MIB
    code, out, err = run(capsys, *args, "--memory-limit", str(cap))
    assert code == 0, err
    assert any(line.startswith("best: zbv with M=4, ZeRO 3/w1,") and "activation checkpointing off" in line
               for line in out.splitlines())
    assert "decided by memory: zbv M=4 ZeRO 2 needs " in out and "ZeRO 3/w1 fits at" in out
    code, _, err = run(capsys, *args, "--memory-limit", str(cap), "--reshard-windows", "all")
    assert code == 2 and "the smallest feasible cap is" in err
    code, _, err = run(capsys, *args, "--memory-limit", str(cap), "--reshard-windows", "0")
    assert code == 2 and "reshard-windows must be >= 1" in err


def test_plan_takes_checkpointing_policies_and_refuses_a_bad_one(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    parts = tuple(PartProfile(1e-3, 1e-3, 1e-3, 32 * MIB, MIB, MIB, MIB, selective_activation_bytes=12 * MIB,
                              selective_recompute_s=2e-4) for _ in range(4))
    path = tmp_path / "selective.json"
    save_profile(Profile(parts, 4), path)
    args = ("plan", "--profile", str(path), "-p", "2", "--batch", "16", "--schedules", "1f1b", "--microbatches", "8")
    code, out, err = run(capsys, *args, "--memory-limit", "1TiB", "--activation-checkpointing", "selective", "--json")
    assert code == 0, err
    cap = int(json.loads(out)["best"]["peak_bytes"])
    code, out, err = run(capsys, *args, "--memory-limit", str(cap))
    assert code == 0, err
    assert any(line.startswith("best: 1f1b with M=8, ZeRO 0,") and "activation checkpointing selective" in line
               for line in out.splitlines())
    assert "; checkpointing selective (off needs " in out
    code, out, err = run(capsys, *args, "--memory-limit", str(cap), "--activation-checkpointing", "off,full")
    assert code == 0 and "activation checkpointing full" in out
    code, out, err = run(capsys, *args, "--memory-limit", str(cap), "--activation-checkpointing", "partial")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "activation-checkpointing must be off, selective, full, a comma list of them, or auto; got 'partial'" in err


def test_plan_offloads_only_with_a_host_bandwidth(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    parts = tuple(PartProfile(5e-4, 5e-4, 5e-4, 16 * MIB, MIB, MIB, MIB) for _ in range(4))
    path = tmp_path / "offload.json"
    save_profile(Profile(parts, 2), path)
    args = ("plan", "--profile", str(path), "-p", "4", "--batch", "16", "--schedules", "1f1b", "--microbatches", "8",
            "--activation-checkpointing", "off")
    code, out, err = run(capsys, *args, "--memory-limit", "1TiB", "--json")
    assert code == 0, err
    cap = str(int(json.loads(out)["best"]["peak_bytes"]) - 1)
    code, out, err = run(capsys, *args, "--memory-limit", cap)
    assert code == 2 and "no plan fits" in err
    code, out, err = run(capsys, *args, "--memory-limit", cap, "--host-bandwidth", "100GB")
    assert code == 0, err
    assert any(line.startswith("best: 1f1b with M=8, ZeRO 0,") and "activation offload 50%" in line
               for line in out.splitlines())
    assert "; offload 50% (copies add " in out
    code, out, err = run(capsys, *args, "--memory-limit", cap, "--host-bandwidth", "fast")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
