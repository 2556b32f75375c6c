"""benchmarks.vs_torch: the rows from given per-rank samples (medians, ratios, CPU over the ranks, gradient checks)."""

from __future__ import annotations

import pytest

from benchmarks import vs_torch
from benchmarks.models import ModelSpec


def _rank(ours: list[float], torch: list[float], cpu: float, err: float) -> dict[str, dict[str, object]]:
    return {"1f1b": {"samples": {"ours": ours, "torch": torch}, "cpu": {"ours": [cpu] * len(ours),
                                                                       "torch": [2 * cpu] * len(ours)},
                     "grad_error": {"ours": err, "torch": err / 10}}}


def test_rows_compare_medians_and_pair_the_steps_and_sum_cpu_over_ranks() -> None:
    w = vs_torch.Workload("overhead-bound", ModelSpec("mlp", num_layers=2, width=4, batch=4), 0.9, ("1f1b",))
    ranks = [_rank([2.0, 4.0, 6.0], [1.0, 4.0, 3.0], 0.010, 1e-6), _rank([2.0, 4.0, 6.0], [1.0, 4.0, 3.0], 0.020, 1e-3)]
    (row,) = vs_torch.summarize(w, ranks)
    assert row["ratio"] == pytest.approx(4.0 / 3.0) and row["paired_ratio"]["median_s"] == pytest.approx(2.0)
    assert row["cpu_ms"] == {"ours": pytest.approx(30.0), "torch": pytest.approx(60.0)}
    assert row["grad_error"] == {"ours": 1e-3, "torch": 1e-4} and row["grads_match"] == {"ours": False,
                                                                                        "torch": True}
    assert row["target"] == 0.9 and row["torch_class"] == "Schedule1F1B" and row["ours"]["n"] == 3
    (table,) = vs_torch.report({"rows": [row]})
    assert len(table) == 2 and len(set(map(len, table))) == 1  # a header and one row of the same width


def test_the_full_run_compares_three_workloads_against_their_targets() -> None:
    cfg = vs_torch.VsTorchConfig()
    assert [w.name for w in cfg.workloads] == ["overhead-bound", "compute-bound", "overhead-bound, fixed shapes"]
    assert [w.target for w in cfg.workloads] == [1.0, 1.0, 0.9] and cfg.world == 4
    assert not cfg.workloads[2].check_inputs_every_step and cfg.workloads[2].schedules == ("1f1b",)
