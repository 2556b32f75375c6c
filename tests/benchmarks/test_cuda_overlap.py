"""benchmarks/cuda_overlap.py: its summary arithmetic and its refusal without a GPU (the probe needs one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import cuda_overlap  # noqa: E402


def test_summary_reports_the_share_of_the_shorter_part_hidden() -> None:
    result = {"spin_ms": 100.0, "median_ms": {"compute": 100.0, "recv": 120.0, "overlapped": 130.0,
                                               "serialized": 220.0}}
    text = cuda_overlap.summary(result, cuda_overlap.CudaOverlapConfig(mib=256.0, reps=7))
    assert "256 MiB message, 100.0 ms GPU spin, median of 7:" in text
    assert "hidden by the P2P stream: 90% of the shorter part" in text  # (100 + 120 - 130) / 100
    assert "(serialized / overlapped = 1.69)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_exits_2_saying_so(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cuda_overlap.main([])
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
