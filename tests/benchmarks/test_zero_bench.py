"""benchmarks.zero_bench: summary, tables and profile areas from given runs; the config's refusals."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

from benchmarks import zero_bench as bench

CFG = bench.ZeroBenchConfig(steps=30, tail=5)


def _run(label: str, stage: int, loss: float, **per_step: float) -> dict[str, Any]:
    return {"label": label, "stage": stage, "losses": [loss] * CFG.steps, "step_s": [0.1] * CFG.steps,
            "bytes": {k: [v] * CFG.steps for k, v in per_step.items()}, "meter_matches_dispatch": True}


RUNS = [
    _run("zero_stage=0 (all-reduce)", 0, 2.0, all_reduce=800.0),
    _run("ZeRO-1", 1, 2.0, reduce_scatter=400.0, all_gather=400.0),
    _run("ZeRO-1 + qgZ", 1, 2.01, all_to_all=100.0, all_gather=400.0),
    _run("ZeRO-1 + qgZ + qwZ", 1, 2.03, all_to_all=100.0, all_gather=150.0),
]


def test_quantized_runs_are_compared_with_the_exact_run_of_their_stage() -> None:
    rows = {r["label"]: r for r in bench.summarize(RUNS, CFG)}
    qgz, both = rows["ZeRO-1 + qgZ"], rows["ZeRO-1 + qgZ + qwZ"]
    assert qgz["grad_fewer"] == pytest.approx(4.0) and qgz["weight_fewer"] == pytest.approx(1.0)
    assert qgz["loss_rel"] == pytest.approx(0.005)
    assert both["weight_fewer"] == pytest.approx(400 / 150) and both["loss_rel"] == pytest.approx(0.015)
    assert rows["ZeRO-1"]["same_losses_as_stage0"] is True and rows["ZeRO-1"]["step_ms"] == pytest.approx(100.0)
    assert bench._quantized_ratios(qgz) == [pytest.approx(4.0)]  # only qgZ's half is judged
    table = bench.zero_pp_table(list(rows.values()), CFG.tail)
    assert len(table) == 1 + len(RUNS) and len(set(map(len, table))) == 1
    assert [r[7] for r in table[1:]] == ["-", "-", "met", "**missed**"]  # 2.67x and 1.5%: both miss


def test_the_report_shows_the_sections_run() -> None:
    memory = [{"pp": 2, "dp": 2, "stage": s, "state": 1000 / (1 + (s > 0)), "grads": 500.0, "params": 500.0,
               "state_frac": 1 / (1 + (s > 0)), "grads_frac": 1.0, "params_frac": 1.0} for s in (0, 1)]
    result = {"config": asdict(CFG), "memory": memory, "rows": bench.summarize(RUNS, CFG), "runs": RUNS, "speed": [],
              "profile": {"1": {"optimizer": 1.0}, "2": {"optimizer": 3.5, "duplexpipe": 2.0}}}
    tables = [b for b in bench.report(result) if isinstance(b, list)]
    assert [len(t) for t in tables] == [3, 1 + len(RUNS), 4]  # memory, ZeRO++, profile (2 areas and the total)
    assert tables[0][2][2:4] == ["0.5", "0.500"] and tables[2][-1] == ["total", "1.0", "5.5", "+4.5"]
    assert [t[0] for t in tables[2][1:3]] == ["optimizer", "duplexpipe"]  # largest difference first
    assert any("bit-identical" in b for b in bench.report(result) if isinstance(b, str))


def test_speed_rows_take_the_slowest_rank_per_step_and_compare_with_zero_1() -> None:
    def rank(scale: float) -> dict[int, dict[str, list[float]]]:
        return {s: {"wall": [0.1 * (1 + s) * scale, 0.2 * scale, 0.3 * scale], "cpu": [0.01 * (1 + s)] * 3}
                for s in bench.SPEED_STAGES}

    rows = {r["stage"]: r for r in bench.speed_rows([rank(1.0), rank(2.0)])}
    assert rows[1]["wall_ms"] == pytest.approx(400.0)  # median of the slowest rank's 400, 400, 600
    assert rows[2]["cpu_ms"] == pytest.approx(30.0) and rows[2]["cpu_vs_1"] == pytest.approx(1.5)
    assert rows[2]["wall_vs_1"] == pytest.approx(600 / 400) and rows[1]["wall_vs_1"] == 1.0


def test_the_profile_charges_functions_to_areas_and_sums_them() -> None:
    assert bench.area_of("/x/torch/distributed/fsdp/_fully_shard/_fsdp_state.py", "_pre_forward") \
        == "FSDP2 hooks and bookkeeping"
    assert bench.area_of("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>").startswith("autograd")
    assert bench.area_of("/x/y.py", "f").startswith("other")
    adam = ("/x/torch/optim/adam.py", 1, "_single_tensor_adam")
    grads = ("/x/duplexpipe/parallel/grads.py", 1, "_sum_squares")
    mul = ("~", 0, "<method 'mul_' of 'torch._C.TensorBase' objects>")
    stats = {adam: (1, 1, 0.002, 0.01, {}), grads: (1, 1, 0.001, 0.002, {}),
             mul: (4, 4, 0.004, 0.004, {adam: (3, 3, 0.003, 0.003), grads: (1, 1, 0.001, 0.001)})}
    assert bench.charged(stats, 2) == pytest.approx({"optimizer": 2.5, "duplexpipe": 1.0})


def test_too_few_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="steps must be >= tail"):
        bench.ZeroBenchConfig(steps=3)
