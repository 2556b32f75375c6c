"""benchmarks.adaptive_comm's checks and report on a made-up result (its quick run spawns 4 processes per link
condition: `python -m benchmarks.adaptive_comm --quick`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import adaptive_comm
from benchmarks.framework import text_table

CFG = adaptive_comm.QUICK


def _variant(step_s: float, loss: float, share: float = 0.0) -> dict[str, Any]:
    steps = [step_s] * CFG.steps
    return {"mean_step_s": step_s, "loss": loss, "losses": [loss] * CFG.steps, "step_s": steps, "exposed_s": 0.0,
            "wire_bytes": 1.0, "controller_share": share, "controller_cpu_share": share / 2,
            "choices": [[("bucket 0", "none")]] * CFG.steps}


def _row(name: str, none: float, bf16: float, int8: float, adaptive: float, loss: float = 3.0) -> dict[str, Any]:
    return {"condition": name, "variants": {"none": _variant(none, 3.0), "bf16": _variant(bf16, 3.0),
                                            "int8": _variant(int8, 3.0), "adaptive": _variant(adaptive, loss, 0.002)}}


def test_the_targets_are_judged_per_condition(tmp_path: Path) -> None:
    fixed = _row("40 MB/s", 0.2, 0.15, 0.3, 0.16)  # within 10% of bf16's
    slow = _row("8 MB/s", 0.2, 0.15, 0.3, 0.17, loss=3.05)  # 13% over; loss 1.7% over
    changing = _row("400 -> 8 MB/s", 0.2, 0.15, 0.3, 0.149)  # faster than every static
    checks = [adaptive_comm._checks(r, k == 2) for k, r in enumerate((fixed, slow, changing))]
    assert [c["speed_ok"] for c in checks] == [True, False, True]
    assert [c["loss_ok"] for c in checks] == [True, False, True] and all(c["cost_ok"] for c in checks)
    assert checks[0]["ratio"] == pytest.approx(0.16 / 0.15)
    assert not adaptive_comm._checks(_row("x", 0.2, 0.15, 0.3, 0.151), True)["speed_ok"]
    result = {"rows": [fixed, slow, changing], "config": adaptive_comm.asdict(CFG)}
    table = adaptive_comm.report(result)[1]
    assert isinstance(table, list) and len(table) == 4
    text = text_table(table)
    assert "1.067x" in text and "< 1 (faster than all)" in text and "+1.67%" in text
    drawn = adaptive_comm.figures(result, str(tmp_path))
    assert [name for name, _ in drawn] == ["adaptive_comm.png"]
    assert (tmp_path / "adaptive_comm.png").stat().st_size > 0


def test_too_few_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="steps must be >= max\\(tail, timed_from\\) \\+ 2, got 5"):
        adaptive_comm.AdaptiveBenchConfig(steps=5)


@pytest.mark.parametrize(("seconds", "cores", "verdict", "said"), [(0.0015, 2, "yes", "a core per rank"),
                                                                    (0.0017, 1, "**no**", "more ranks than cores")])
def test_the_controller_cost_with_a_core_per_rank_is_judged_on_the_shortest_step(seconds: float, cores: int,
                                                                                 verdict: str, said: str) -> None:
    """Judged on its seconds over the shortest adaptive step of the rows (0.16 s: 1% is 1.6 ms), not its own step."""
    cost = {"pp": 1, "dp": 2, "steps": 60, "bandwidth": 8e6, "cores": cores, "controller_s": seconds,
            "controller_cpu_s": seconds / 3, "controller_share": seconds / 0.4, "controller_cpu_share": seconds / 1.2,
            "mean_step_s": 0.4}
    rows = [_row("8 MB/s", 0.2, 0.15, 0.3, 0.16), _row("1 MB/s", 0.4, 0.3, 0.3, 0.31)]
    blocks = adaptive_comm.report({"rows": rows, "cost": cost, "config": adaptive_comm.asdict(CFG)})
    line = blocks[-1]
    assert isinstance(line, str) and said in line, line
    assert f"{seconds / 0.16:.3%} of the shortest adaptive step above (160.0 ms; target at most 1%: {verdict})" in line
    row = rows[0]
    assert len(adaptive_comm.report({"rows": [row], "config": adaptive_comm.asdict(CFG)})) == 2  # no cost run: no line
