"""benchmarks.plan_tp: the rows from given per-rank results (predicted and measured ranks of every mesh) and the
report's verdict on the planner's first choice."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from benchmarks import plan_tp

MESHES = ((4, 1, 1), (2, 1, 2))


def _lead(measured: list[float], predicted: list[float]) -> dict[str, Any]:
    rows = {f"{p}x{d}x{t}": {"step_s": s, "peak_bytes": 1.0} for (p, d, t), s in zip(MESHES, predicted, strict=True)}
    best = min(rows, key=lambda m: rows[m]["step_s"])
    return {"seconds": [[m, m, m] for m in measured], "param_bytes": [4, 2],
            "predicted": {k: {"best": best, "rows": rows} for k in ("model", "barrier_link")}}


def test_rows_rank_the_meshes_both_ways_and_the_report_says_whether_the_choice_held() -> None:
    cfg = plan_tp.PlanTPConfig(meshes=MESHES)
    lead = _lead([0.3, 0.2], [0.1, 0.2])  # the planner prefers 4x1x1; 2x1x2 measured faster
    rows = plan_tp.summarize([lead, {"param_bytes": [4, 3]}], cfg)
    assert [(r["mesh"], r["predicted_rank"], r["measured_rank"]) for r in rows] == [("4x1x1", 1, 2), ("2x1x2", 2, 1)]
    assert rows[0]["param_bytes"] == [4, 4] and rows[1]["param_bytes"] == [2, 3]
    part = {"rows": rows, "config": asdict(cfg), "best_measured": "2x1x2", "best_model": "4x1x1",
            "best_barrier_link": "4x1x1", "tp_work_s": 1e-3, "tp_busy_s": 2e-3,
            "cores": 2, "overhead": {"action_s": 1e-4, "message_s": 1e-4, "step_s": 0.0},
            "links": {k: {"latency_s": 1e-4, "bandwidth": 1e9} for k in ("p2p", "tp", "dp")},
            "profile": {"parts": [{}, {"tp": {"forward_collectives": 2, "backward_collectives": 4}}]}}
    blocks = plan_tp.report(part)
    assert isinstance(blocks[1], list) and len(blocks[1]) == 3
    assert "first choice measured best: **no**" in str(blocks[2]) and "2 collectives forward, 4 backward" in blocks[0]
