"""torch.profiler traces of chosen training steps (`MetricsConfig.profile_steps`): one Chrome trace per rank."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from duplexpipe.files import write_atomic
from duplexpipe.launch.train_config import profile_range


class StepProfiler:
    """Traces steps A..B of a run (1-based, inclusive; a resumed run from its first step inside them) and writes this
    rank's trace to <out_dir>/profile/rank-N.json when step B is done; without `steps`, nothing."""

    def __init__(self, steps: str | None, out_dir: str | None, rank: int) -> None:
        self.range = profile_range(steps) if steps is not None else None
        self.path = Path(out_dir or ".") / "profile" / f"rank-{rank}.json"
        self._profiler: profile | None = None

    def before(self, step: int) -> None:
        """Step `step` (1-based) is about to run: start tracing at the range's first step."""
        if self.range is not None and self._profiler is None and self.range[0] <= step <= self.range[1]:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profiler = profile(activities=activities)
            self._profiler.start()

    def after(self, step: int) -> Path | None:
        """Step `step` is done: at the range's last step, stop and write the trace; its path then, else None."""
        if self._profiler is None or self.range is None or step != self.range[1]:
            return None
        self._profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as private:  # torch writes where it is told: a folder only we can enter
            exported = Path(private) / self.path.name
            self._profiler.export_chrome_trace(str(exported))
            write_atomic(self.path, exported.read_bytes())  # never through a link planted in the run folder
        self._profiler = None
        return self.path

    def close(self) -> None:
        """Stop a trace a failed run left open (nothing is written)."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
