"""benchmarks.profile_runtime: py-spy's raw stacks bucketed per side and summed per function; its report."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import profile_runtime

STEP = "Pipeline.step (duplexpipe/train/trainer.py:104)"
RUN = "PipelineRuntime._run (duplexpipe/runtime/executor.py:340)"
RAW = [
    f"process 1:\"x\";main (a.py:1);{STEP};{RUN};MailTransport.take (duplexpipe/runtime/transport.py:145) 30",
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
    assert found["ms_per_step_rank"] == {"wait for a receive (MailTransport.take)": 30.0,
                                         "forward compute (module + loss)": 20.0,
                                         "trainer: optimizer step, norm, zero_grad": 10.0}
    assert found["step_ms_under_profiler"] == pytest.approx(60.0)
    assert sum(found["share"].values()) == pytest.approx(1.0)


def test_top_functions_are_inclusive_from_the_step_down_and_self_at_the_leaf(raw: str) -> None:
    found = profile_runtime.summarize_raw(raw, "ours", steps=2, ranks=1, rate=1000)
    assert found["inclusive_ms"]["Pipeline.step (trainer.py)"] == pytest.approx(30.0)
    assert found["inclusive_ms"]["PipelineRuntime._run (executor.py)"] == pytest.approx(25.0)
    assert "main (a.py)" not in found["inclusive_ms"]  # frames above the step are not the step's
    assert found["self_ms"] == {"MailTransport.take (transport.py)": 15.0, "linear (functional.py)": 10.0,
                                "Pipeline._apply (trainer.py)": 5.0}


def test_the_report_holds_a_row_per_bucket_and_the_what_if_and_look_ahead_tables(raw: str) -> None:
    prof = profile_runtime.summarize_raw(raw, "ours", steps=1, ranks=1, rate=1000)
    whatif = {"schedule": "1f1b", "workload": "mlp", "median_s": {v: 0.01 for v in profile_runtime.WHATIF_VARIANTS},
              "speedup": {v: 1.0 for v in profile_runtime.WHATIF_VARIANTS}}
    result = {"cases": [{"schedule": "1f1b", "workload": "mlp", "ours": prof, "torch": prof}], "skipped": "",
              "whatif": [whatif], "config": {"top": 2}}
    blocks = profile_runtime.report(result)
    tables = [b for b in blocks if isinstance(b, list)]
    assert len(tables[0]) == 1 + 2 * len(prof["ms_per_step_rank"])  # a row per bucket and side
    assert len(tables) == 1 + 2 + 1 and all(len(t) == 3 for t in tables[1:3])  # top 2 functions per side
    assert len(tables[-1]) == 1 + len(profile_runtime.WHATIF_VARIANTS)
    skipped = profile_runtime.report({**result, "cases": [], "skipped": "no py-spy", "config": {}})
    assert len(skipped[0]) == 2 and "no py-spy" in skipped[0][1][2]
    look = {"lookahead": {"lookahead 0": {"wall_ms": 2.0, "cpu_ms": 3.0, "ratio": 1.1, "paired": 1.0},
                          "torch": {"wall_ms": 1.8, "cpu_ms": 2.0, "ratio": 1.0, "paired": 1.0}}}
    (table,) = profile_runtime.report(look)
    assert [r[0] for r in table[1:]] == ["lookahead 0", "torch"]
