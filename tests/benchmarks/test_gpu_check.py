"""benchmarks.gpu_check: the CPU dry run prints the GPU run's plan and its own and records every part; a raising
part loses no other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_check

DRY_RUN_TIMEOUT_S = 150  # the dry run takes well under a minute alone; the margin is for a loaded machine


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], str]:
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out)],
                          cwd=gpu_check.ROOT, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(gpu_check.ROOT), os.environ.get("PYTHONPATH", "")])})
    result = json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))
    return done, result, (out / "gpu_check.md").read_text(encoding="utf-8")


@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 30)
def test_the_dry_run_prints_the_plan_and_passes(dry_run: tuple[Any, dict[str, Any], str]) -> None:
    done, result, _ = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("the GPU run's " + gpu_check.plan(gpu_check.GPU) + "\nthis dry run's plan:")
    gpu_total = sum(gpu_check.GPU.expected.values())
    assert f"total     expect {gpu_total:4.0f} s" in done.stdout and "device time limit 480 s" in done.stdout
    for name in gpu_check.PARTS:
        assert done.stdout.count(f"  {name} ") >= 2  # in both plans
    assert result["dry_run"] is True


def test_every_part_holds_figures_or_a_reason(dry_run: tuple[Any, dict[str, Any], str]) -> None:
    _, result, table = dry_run
    parts = result["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    for name, entry in parts.items():
        assert entry["status"] == "ok" and entry["figures"] or entry.get("reason"), (name, entry)
        assert entry["seconds"] <= entry["budget_s"] + 5, (name, entry)
        assert f"| {name} | {entry['status']} |" in table
    overhead = parts["overhead"]["figures"]
    assert overhead["ours_over_plain"]["ratio"] > 0 and overhead["tokens_per_s"] > 0
    assert overhead["mfu"] is None and overhead["peak_flops"] is None  # no peak for the CPU
    assert parts["compile"]["figures"]["plain_compiled_over_eager"]["ratio"] > 0
    if gpu_check.float8_name() is None:
        assert parts["float8"]["status"] == "not landed" and "issue 44" in parts["float8"]["reason"]
    variants = parts["memory"]["figures"]["variants"]
    assert set(variants) == set(gpu_check.MEMORY_VARIANTS)
    assert all(v["max_total_peak"] > 0 and v["step_s"]["median_s"] > 0 for v in variants.values())
    cuda = parts["cuda"]["figures"]
    assert cuda["pytest"]["rc"] in (0, 5) and cuda["moe_pair"]["pair_ratio"] > 0  # 5: all deselected
    assert result["device"] == {"gpu": "cpu", "torch": gpu_check.torch.__version__, "cuda": None, "nccl": None,
                                "gpus": 0} or result["device"]["gpu"] != "cpu"
    assert table.startswith("GPU ")


def test_a_raising_part_is_recorded_and_the_others_still_run(tmp_path: Path) -> None:
    def boom(sizes: gpu_check.Sizes, deadline: float) -> dict[str, Any]:
        raise RuntimeError("injected failure")

    def fine(sizes: gpu_check.Sizes, deadline: float) -> dict[str, Any]:
        return {"value": 1.0}

    runners = {"first": fine, "boom": boom, "float8": gpu_check.run_float8, "last": fine}
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)], runners=runners) == 1
    parts = json.loads((tmp_path / "gpu_check.json").read_text(encoding="utf-8"))["parts"]
    assert list(parts) == list(runners)
    assert parts["boom"]["status"] == "failed" and parts["boom"]["reason"] == "RuntimeError: injected failure"
    assert "injected failure" in parts["boom"]["traceback"]
    assert parts["first"]["status"] == "ok" and parts["first"]["figures"] == {"value": 1.0}
    assert parts["last"]["status"] == "ok" and parts["float8"]["status"] in ("ok", "not landed")
    assert "| boom | failed |" in (tmp_path / "gpu_check.md").read_text(encoding="utf-8")


def test_the_gpu_run_fits_its_device_time() -> None:
    assert sum(gpu_check.GPU.budgets.values()) <= gpu_check.DEVICE_MINUTES * 60 - 30  # 30 s to start the processes
    assert sum(gpu_check.GPU.expected.values()) < sum(gpu_check.GPU.budgets.values())
    assert set(gpu_check.GPU.budgets) == set(gpu_check.DRY.budgets) == set(gpu_check.PARTS)
    assert sum(gpu_check.DRY.expected.values()) < 60


def test_peak_and_flops() -> None:
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_check.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_check.peak_flops("NVIDIA H200") == 989e12
    assert gpu_check.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_check.peak_flops("cpu") is None and gpu_check.peak_flops("Tesla T4") is None
    sizes = gpu_check.DRY
    tokens = sizes.microbatch * sizes.microbatches * sizes.seq
    assert gpu_check.step_flops(sizes, 1000) == 6 * 1000 * tokens + 12 * sizes.layers * sizes.width * sizes.seq * tokens


def test_the_zero_mesh_follows_the_world() -> None:
    assert gpu_check.zero_mesh(2) == (1, 2)
    assert gpu_check.zero_mesh(4) == (2, 2)


def test_make_bench_runs_it_only_where_cuda_is() -> None:
    makefile = (gpu_check.ROOT / "Makefile").read_text(encoding="utf-8")
    bench = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert "torch.cuda.is_available()" in bench and "-m benchmarks.gpu_check" in bench
    assert bench.index("torch.cuda.is_available()") < bench.index("-m benchmarks.gpu_check")


def test_without_cuda_the_full_run_asks_for_the_dry_run(tmp_path: Path) -> None:
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the full run would start")
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path)])
    assert not (tmp_path / "gpu_check.json").exists()
