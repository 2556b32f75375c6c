"""benchmarks.cuda_overlap: its summary arithmetic and its refusal without a GPU (the probe needs one)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import cuda_overlap


def test_the_report_gives_the_share_of_the_shorter_part_hidden() -> None:
    result = {"spin_ms": 100.0, "config": {"mib": 256.0, "reps": 7},
              "median_ms": {"compute": 100.0, "recv": 120.0, "overlapped": 130.0, "serialized": 220.0}}
    summary, table = cuda_overlap.report(result)
    assert "90%" in summary and "1.69" in summary  # (100 + 120 - 130) / 100 hidden; serialized / overlapped
    assert [r[0] for r in table[1:]] == list(cuda_overlap.MODES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_so() -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        cuda_overlap.run(cuda_overlap.PART.quick)
    with pytest.raises(ValueError, match="need mib > 0"):
        cuda_overlap.CudaOverlapConfig(mib=0)
