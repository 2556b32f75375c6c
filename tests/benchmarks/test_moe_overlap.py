"""benchmarks/moe_overlap.py: its summary arithmetic, its report and docs section, its refusals (no runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import moe_overlap  # noqa: E402


def _rank(seq: list[float], ovl: list[float], comm: list[float], measured: list[float],
          cpu: list[float] | None = None) -> dict:
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
    assert "at most 60% of the comm can be hidden here" in moe_overlap.report(busiest, moe_overlap.MoEBenchConfig())


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


def test_a_two_rank_run_says_so_and_has_its_own_docs_section() -> None:
    out = {**moe_overlap.summary([_rank([1.0], [0.7], [0.4], [1.0])]),
           "config": moe_overlap.asdict(moe_overlap.MoEBenchConfig(steps=0, ranks=2)), "machine": {"cores": 2}}
    text = moe_overlap.markdown(out)
    assert "2 gloo processes" in text and "moe_overlap.py --ranks 2 --tokens" in text
    assert moe_overlap.markers(2)[0] != moe_overlap.BEGIN and moe_overlap.markers(4) == (moe_overlap.BEGIN,
                                                                                          moe_overlap.END)


@pytest.mark.parametrize(("argv", "needle"), [(["--reps", "0"], "need --reps"),
                                              (["--experts", "6"], "--experts must be a multiple of 4"),
                                              (["--ranks", "3"], "invalid choice: 3")])
def test_bad_arguments_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        moe_overlap.main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err
