"""benchmarks/moe_overlap.py: its summary arithmetic, its report and docs section, its refusals (no runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import moe_overlap  # noqa: E402


def _rank(seq: list[float], ovl: list[float], comm: list[float], measured: list[float]) -> dict:
    return {"pairs": {"sequential": seq, "overlapped": ovl, "comm": comm, "measured": measured},
            "link": {"latency_s": 0.0, "bandwidth_bytes_per_s": 1e6}}


def test_summary_takes_the_slowest_rank_per_rep_then_the_median() -> None:
    results = [_rank([1.0, 2.0, 3.0], [0.6, 0.6, 0.6], [0.5, 0.5, 0.5], [1.1, 1.1, 1.1]),
               _rank([2.0, 1.0, 2.0], [0.5, 0.7, 0.5], [0.4, 0.6, 0.5], [1.0, 1.2, 1.0])]
    s = moe_overlap.summary(results)
    assert s["sequential_ms"] == pytest.approx(2000.0) and s["overlapped_ms"] == pytest.approx(600.0)
    assert s["comm_ms"] == pytest.approx(500.0) and s["compute_ms"] == pytest.approx(600.0)
    assert s["pair_ratio"] == pytest.approx(0.3) and s["hidden"] == pytest.approx((2.0 - 0.6) / 0.5)


def test_report_and_docs_section_name_the_link_and_the_command() -> None:
    results = [_rank([1.0], [0.7], [0.4], [1.0])]
    out = {**moe_overlap.summary(results), "config": moe_overlap.asdict(moe_overlap.MoEBenchConfig(steps=0)),
           "machine": {"cores": 2, "torch": "2.13.0"}}
    text = moe_overlap.markdown(out)
    assert "emulated link 1.0 MB/s" in text and "python benchmarks/moe_overlap.py --tokens 512" in text
    assert "hidden 75% of the comm" in text
    assert "Targets: pair <= 0.75x F then B: met (0.70x); >= 70% of the comm hidden: met (75%)." in text
    nccl = {**out, "config": moe_overlap.asdict(moe_overlap.MoEBenchConfig(steps=0, backend="nccl"))}
    assert "Target: >= 80% of the comm hidden: missed (75%)." in moe_overlap.markdown(nccl)


@pytest.mark.parametrize(("argv", "needle"), [(["--reps", "0"], "need --reps"),
                                              (["--experts", "6"], "--experts must be a multiple of 4")])
def test_bad_arguments_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        moe_overlap.main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err
