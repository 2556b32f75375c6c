"""benchmarks.moe_overlap: its summary arithmetic, its report and docs block, its config's refusals (no runs)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

from benchmarks import moe_overlap


def _rank(seq: list[float], ovl: list[float], comm: list[float], measured: list[float],
          cpu: list[float] | None = None) -> dict[str, Any]:
    pairs = {"sequential": seq, "overlapped": ovl, "comm": comm, "measured": measured}
    return {"pairs": pairs if cpu is None else {**pairs, "overlapped_cpu": cpu},
            "link": {"latency_s": 0.0, "bandwidth_bytes_per_s": 1e6}, "cores": 2}


def test_summary_takes_the_slowest_rank_per_rep_then_the_median() -> None:
    results = [_rank([1.0, 2.0, 3.0], [0.6, 0.6, 0.6], [0.5, 0.5, 0.5], [1.1, 1.1, 1.1]),
               _rank([2.0, 1.0, 2.0], [0.5, 0.7, 0.5], [0.4, 0.6, 0.5], [1.0, 1.2, 1.0])]
    s = moe_overlap.summary(results)
    assert s["sequential_ms"] == pytest.approx(2000.0) and s["overlapped_ms"] == pytest.approx(600.0)
    assert s["comm_ms"] == pytest.approx(500.0) and s["compute_ms"] == pytest.approx(1500.0)
    assert s["pair_ratio"] == pytest.approx(0.3) and s["hidden"] == pytest.approx((2.0 - 0.6) / 0.5)


def test_the_cores_bound_is_the_ranks_cpu_over_the_cores_or_the_busiest_rank() -> None:
    ranks = [_rank([1.0, 1.0], [0.8, 0.8], [0.5, 0.5], [1.1, 1.1], cpu=[0.3, 0.6]) for _ in range(4)]
    s = moe_overlap.summary(ranks)
    assert s["cpu_bound_ms"] == pytest.approx(900.0)  # per rep 4 x 0.3 / 2 = 0.6 and 4 x 0.6 / 2 = 1.2
    assert s["hidden_at_most"] == pytest.approx((1.0 - 0.9) / 0.5)
    busiest = moe_overlap.summary([_rank([1.0], [0.8], [0.5], [1.1], cpu=[0.7])])
    assert busiest["cpu_bound_ms"] == pytest.approx(700.0) and busiest["hidden_at_most"] == pytest.approx(0.6)


@pytest.mark.parametrize(("backend", "hidden", "verdicts"), [("gloo", 0.75, ["met", "met"]),
                                                              ("nccl", 0.75, ["missed"])])
def test_the_report_judges_the_targets_of_its_backend(backend: str, hidden: float, verdicts: list[str]) -> None:
    s = {**moe_overlap.summary([_rank([1.0], [0.7], [0.4], [1.0])]),
         "config": asdict(moe_overlap.MoEBenchConfig(steps=0, backend=backend))}
    assert s["hidden"] == pytest.approx(hidden) and s["pair_ratio"] == pytest.approx(0.7)
    workload, table, targets = moe_overlap.report(s)
    assert [r[0] for r in table[1:]] == ["F then B", "overlapped"] and len(set(map(len, table))) == 1
    words = targets.replace(";", " ").replace("*", "").split()
    assert [w for w in words if w in ("met", "missed")] == verdicts


def test_a_two_rank_run_and_a_qwen3_run_have_their_own_docs_blocks() -> None:
    block = moe_overlap.PART.block_of
    assert block({"config": asdict(moe_overlap.MoEBenchConfig(ranks=2))}) == "moe-overlap-2"
    assert block({"config": asdict(moe_overlap.MoEBenchConfig())}) == block({}) == "moe-overlap"
    assert block({"config": asdict(moe_overlap.MoEBenchConfig(model="qwen3_moe"))}) == "moe-overlap-qwen3"


def test_a_qwen3_stage_is_transformers_decoder_layers_with_spread_experts() -> None:
    """model=qwen3_moe: the pair's stage is the middle part of a transformers Qwen3-MoE model (its decoder layers,
    each sparse block a duplexpipe.moe layer holding this rank's quarter of the experts), and the report names it."""
    pytest.importorskip("transformers")
    import torch

    from duplexpipe.moe import moe_layers

    cfg = moe_overlap.MoEBenchConfig(model="qwen3_moe", tokens=32, dim=16, hidden=8, seq=8)
    stage = moe_overlap._model(cfg, torch.device("cpu"), 1, 4)
    assert type(stage.layers["1"]).__name__ == "Qwen3MoeDecoderLayer" and list(stage.layers) == ["1", "2"]
    assert [layer.local_experts for layer in moe_layers(stage)] == [[2, 3], [2, 3]]
    s = {**moe_overlap.summary([_rank([1.0], [0.7], [0.4], [1.0])]), "config": asdict(cfg)}
    assert "2 Qwen3-MoE decoder layers of transformers" in moe_overlap.report(s)[0]


@pytest.mark.parametrize(("changes", "needle"), [({"reps": 0}, "need reps"), ({"experts": 6}, "multiple of 4"),
                                                 ({"ranks": 3}, "ranks must be 2 or 4"),
                                                 ({"tokens": 100}, "dividing tokens"),
                                                 ({"model": "olmoe"}, "model must be one of")])
def test_bad_configs_are_refused(changes: dict[str, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        moe_overlap.MoEBenchConfig(**changes)
