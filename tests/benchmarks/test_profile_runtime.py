"""benchmarks/profile_runtime.py: py-spy's raw stacks are bucketed per side and summed per function."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import profile_runtime  # noqa: E402

STEP = "OursTrainer.step (benchmarks/ours_side.py:104)"
RUN = "PipelineRuntime._run (duplexpipe/runtime/executor.py:340)"
RAW = [
    f"process 1:\"x\";main (a.py:1);{STEP};{RUN};Transport.take (duplexpipe/runtime/transport.py:145) 30",
    f"process 1:\"x\";main (a.py:1);{STEP};{RUN};Dispatcher.run_forward (duplexpipe/runtime/dispatch.py:60);"
    "linear (torch/nn/functional.py:9) 20",
    f"process 1:\"x\";main (a.py:1);{STEP};Pipeline._apply (duplexpipe/train/trainer.py:440) 10",
    "process 1:\"x\";main (a.py:1);setup (a.py:5) 99",
]


@pytest.fixture
def raw(tmp_path: Path) -> str:
    path = tmp_path / "raw.txt"
    path.write_text("\n".join(RAW) + "\n", encoding="utf-8")
    return str(path)


def test_buckets_count_only_samples_inside_a_step(raw: str) -> None:
    found = profile_runtime.summarize_raw(raw, "ours", steps=1, ranks=1, rate=1000)
    assert found["samples"] == 60
    assert found["ms_per_step_rank"] == {"wait for a receive (Transport.take)": 30.0,
                                         "forward compute (module + loss)": 20.0,
                                         "trainer: optimizer step, norm, zero_grad": 10.0}
    assert found["step_ms_under_profiler"] == pytest.approx(60.0)
    assert sum(found["share"].values()) == pytest.approx(1.0)


def test_top_functions_are_inclusive_from_the_step_down_and_self_at_the_leaf(raw: str) -> None:
    found = profile_runtime.summarize_raw(raw, "ours", steps=2, ranks=1, rate=1000)
    assert found["inclusive_ms"]["OursTrainer.step (ours_side.py)"] == pytest.approx(30.0)
    assert found["inclusive_ms"]["PipelineRuntime._run (executor.py)"] == pytest.approx(25.0)
    assert "main (a.py)" not in found["inclusive_ms"]  # frames above the step are not the step's
    assert found["self_ms"] == {"Transport.take (transport.py)": 15.0, "linear (functional.py)": 10.0,
                                "Pipeline._apply (trainer.py)": 5.0}
