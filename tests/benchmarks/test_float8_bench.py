"""benchmarks.float8_bench's report: the loss verdict against bf16, and the speed said not measured without FP8 GEMMs
(the measuring run is the part's own: `python -m benchmarks.float8_bench --quick`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from benchmarks import float8_bench
from benchmarks.framework import render


def _result(float8_loss: float, speed: float | None) -> dict[str, Any]:
    rows = {name: {"loss_last": loss, "losses": [loss], "tokens_per_s": 1000.0}
            for name, loss in (("fp32", 2.0), ("bf16", 2.0), ("float8", float8_loss))}
    return {"rows": rows, "loss_ratio": float8_loss / 2.0, "loss_ratio_fp32": float8_loss / 2.0, "speed_ratio": speed,
            "device": "cpu" if speed is None else "NVIDIA H100", "config": asdict(float8_bench.QUICK)}


def test_the_loss_verdict_and_an_unmeasured_speed() -> None:
    text = render(float8_bench.report(_result(2.02, None)), markdown=False)
    assert "Final loss float8 / bf16: 1.0100" in text and "target within 2%: yes" in text
    assert "Speed was not measured: cpu has no FP8 GEMMs" in text
    text = render(float8_bench.report(_result(2.1, 1.31)), markdown=False)
    assert "target within 2%: no" in text and "1.31x (target >= 1.2x: yes)" in text
