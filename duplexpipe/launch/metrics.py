"""Training metrics: a JSONL log (one line per step), optional TensorBoard and Weights & Biases scalars, progress
output."""

from __future__ import annotations

import inspect
import json
import logging
import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from duplexpipe.files import naming, open_append, write_atomic

if TYPE_CHECKING:
    from duplexpipe.launch.train_config import TrainConfig
    from duplexpipe.runtime.memory import MemoryReport

log = logging.getLogger("duplexpipe.metrics")

WriterFactory = Callable[[str], Any]
"""Builds a TensorBoard-style writer (`add_scalar(tag, value, step)`, `flush()`, `close()`) for a folder."""
SCALARS = ("loss", "lr", "grad_norm", "items_per_s", "bubble", "eval_loss", "peak_saved_bytes",
           "peak_memory_bytes")
"""The per-step values that also go to TensorBoard (as train/<name>, eval_loss as eval/loss)."""
TAGS = {"eval_loss": "eval/loss"}
"""TensorBoard tags that are not train/<name>."""
WANDB_HINT = "pip install 'duplexpipe[wandb]'"
TENSORBOARD_MISSING = ("TensorBoard scalars are off: the tensorboard package is not installed (pip install "
                       "'duplexpipe[tensorboard]'; --no-tensorboard leaves them off without this line)")
"""The one line a run prints when it would write TensorBoard scalars but cannot."""


def tensorboard_writer() -> WriterFactory | None:
    """torch's SummaryWriter when the tensorboard package is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional: no scalars then
        return None
    return SummaryWriter  # type: ignore[no-any-return]


class WandbWriter:
    """A Weights & Biases run behind the TensorBoard writer's calls: the scalars of a step go as one `log` call."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._step: int | None = None
        self._pending: dict[str, float] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Queue `tag` for `step` (a new step sends the previous one)."""
        if step != self._step:
            self.flush()
            self._step = step
        self._pending[tag] = value

    def flush(self) -> None:
        """Send the queued step."""
        if self._pending:
            self.run.log(self._pending, step=self._step)
            self._pending = {}

    def close(self) -> None:
        """Send the queued step and finish the run."""
        self.flush()
        self.run.finish()


def check_wandb(options: bool | Mapping[str, Any]) -> None:
    """ValueError when `MetricsConfig.wandb` asks for a run the wandb package is missing for, or gives an option
    wandb.init does not take."""
    if options is False:
        return
    try:
        import wandb
    except ImportError:
        raise ValueError(f"--wandb needs the wandb package, which is not installed: {WANDB_HINT}") from None
    taken = inspect.signature(wandb.init).parameters
    unknown = sorted(set(options if isinstance(options, Mapping) else ()) - set(taken) - {"config"})
    if unknown:
        raise ValueError(f"--wandb: wandb.init takes no option(s) {', '.join(unknown)}")


def wandb_writer(options: bool | Mapping[str, Any], folder: str | None, config: Mapping[str, Any]) -> WandbWriter:
    """A wandb run (wandb imported now: it is optional) with `options` for wandb.init, its files under `folder`."""
    import wandb

    given = dict(options) if isinstance(options, Mapping) else {}
    if folder is not None:
        given.setdefault("dir", folder)
    return WandbWriter(wandb.init(config=dict(config), **given))


def open_metrics(config: TrainConfig, start: int) -> MetricsLog | None:
    """The run's metrics on rank 0 (None when it writes none): metrics.jsonl, TensorBoard and wandb as `config.metrics`
    asks, appending after step `start` of a resumed run (later rows of a crashed attempt dropped). TensorBoard
    asked for but not installed: one line says so."""
    metrics = config.metrics
    if metrics.out_dir is None and metrics.wandb is False:
        return None
    out = Path(metrics.out_dir) if metrics.out_dir is not None else None
    factory = tensorboard_writer() if metrics.tensorboard and out is not None else None
    if metrics.tensorboard and out is not None and factory is None:
        print(TENSORBOARD_MISSING, flush=True)
    if out is not None and start:
        _trim_metrics(out / "metrics.jsonl", start)
    writers = [wandb_writer(metrics.wandb, metrics.out_dir, config.to_dict())] if metrics.wandb is not False else []
    return MetricsLog(out / "metrics.jsonl" if out is not None else None,
                      tensorboard_dir=out / "tensorboard" if out is not None else None, writer_factory=factory,
                      append=start > 0, writers=writers)


def _trim_metrics(path: Path, start: int) -> None:
    """Drop the rows after step `start` (written by an attempt that crashed later than its last checkpoint)."""
    if path.is_symlink() or not path.is_file():  # a link is never read or written through: replaced
        return
    rows = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and int(json.loads(line).get("step", 0)) <= start]
    write_atomic(path, "".join(row + "\n" for row in rows))


class MetricsLog:
    """Appends one JSON object per step to a file and mirrors the scalars to a TensorBoard writer and to `writers`
    (each with the TensorBoard writer's `add_scalar`, `flush` and `close`: a `WandbWriter`).

    `path` None: no file. `writer_factory` None: no TensorBoard. Non-finite numbers are written
    as null (JSON has no NaN).
    """

    def __init__(self, path: str | Path | None, *, tensorboard_dir: str | Path | None = None,
                 writer_factory: WriterFactory | None = None, append: bool = False,
                 writers: Sequence[Any] = ()) -> None:
        self._file: IO[str] | None = None
        self._path = str(path)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if not append or Path(path).is_symlink():  # a fresh log, or a link planted there: replaced
                write_atomic(path, "")
            self._file = open_append(path)
        self._writers = list(writers)
        if writer_factory is not None and tensorboard_dir is not None:
            self._writers.insert(0, writer_factory(str(tensorboard_dir)))
            log.info("TensorBoard scalars go to %s", tensorboard_dir)

    def write(self, step: int, values: Mapping[str, float | int | None]) -> None:
        """Record `values` for `step` (1-based: steps completed)."""
        row: dict[str, Any] = {"step": step}
        for key, value in values.items():
            row[key] = value if value is None or not isinstance(value, float) or math.isfinite(value) else None
        if self._file is not None:
            with naming(self._path):
                self._file.write(json.dumps(row) + "\n")
                self._file.flush()
        for writer in self._writers:
            for key in SCALARS:
                if row.get(key) is not None:
                    writer.add_scalar(TAGS.get(key, f"train/{key}"), row[key], step)

    def close(self) -> None:
        """Flush and close the file and the writers."""
        if self._file is not None:
            with naming(self._path):
                self._file.close()
            self._file = None
        for writer in self._writers:
            writer.flush()
            writer.close()
        self._writers = []


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics JSONL file."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


class ProgressBar:
    """A tqdm progress bar on a terminal: steps done, loss and throughput, redrawn in place."""

    def __init__(self, total: int, start: int, unit: str, stream: IO[str]) -> None:
        from tqdm import tqdm

        self.unit = unit
        size = shutil.get_terminal_size()  # a terminal may report no size: tqdm would then draw nothing
        self._bar = tqdm(total=total, initial=start, unit="step", file=stream, ncols=size.columns or 100,
                         nrows=size.lines or 20, leave=True)
        self._done = start

    def update(self, step: int, loss: float, rate: float) -> None:
        """Show step (1-based), loss and throughput."""
        self._bar.set_postfix_str(f"loss {loss:.4f}, " + (f"{rate:,.0f} {self.unit}/s" if rate > 0 else
                                                          "warming up"), refresh=False)
        self._bar.update(step - self._done)
        self._done = step

    def close(self) -> None:
        """End the bar (its last state stays on the terminal)."""
        self._bar.close()


def progress_bar(total: int, start: int, unit: str, stream: IO[str]) -> ProgressBar | None:
    """A ProgressBar when `stream` is a terminal; None for a file or a pipe, where redrawing one line would
    fill the log (the caller then prints plain lines, see plain_every)."""
    isatty = getattr(stream, "isatty", None)
    return ProgressBar(total, start, unit, stream) if isatty is not None and isatty() else None


def plain_every(log_every: int, total: int, progress: bool) -> int:
    """Steps between plain log lines: `log_every`; when it is 0 but a progress display was asked for (and the
    output is no terminal), about 20 lines over the run."""
    return log_every or (max(1, total // 20) if progress else 0)


def log_line(step: int, total: int, values: Mapping[str, Any], unit: str) -> str:
    """One progress line: `step 10/60  loss 2.3012  eval 2.4012  lr 3.00e-03  grad 0.81  12,345 tokens/s` (eval at
    the steps that evaluated)."""
    parts = [f"step {step}/{total}", f"loss {values['loss']:.4f}"]
    if values.get("eval_loss") is not None:
        parts.append(f"eval {values['eval_loss']:.4f}")
    parts.append(f"lr {values['lr']:.2e}")
    if values.get("grad_norm") is not None:
        parts.append(f"grad {values['grad_norm']:.3g}")
    if values.get("items_per_s"):
        parts.append(f"{values['items_per_s']:,.0f} {unit}/s")
    return "  ".join(parts)


def memory_summary(reports: list[MemoryReport]) -> list[str]:
    """The end-of-run lines of the measured memory: one per pipeline rank (`MemoryReport.summary`), then the
    largest peak over the ranks."""
    if not reports:
        return []
    top = max(reports, key=lambda r: r.total_peak)
    return ["measured memory of the last step, per rank (peaks over its actions; total = the peak of the sum):",
            *(f"  {r.summary()}" for r in reports),
            f"  largest: rank {top.rank}, {top.total_peak:,} bytes"]
