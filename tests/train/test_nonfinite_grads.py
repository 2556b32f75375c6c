"""Tests for duplexpipe.train.nonfinite: NaN or inf in the gradients of an fp32 or bf16 step never trains. "raise"
(the default) stops every rank with one error naming the step and the first stage and parameter, before the
optimizer steps; "skip" skips the step everywhere and counts it; the logged norm is NaN, never a masked number."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _train_helpers import adam, batch, make_parts, mse
from models import run_workers

from duplexpipe.cli import main as cli_main
from duplexpipe.errors import NonFiniteGradientError
from duplexpipe.launch.metrics import read_metrics
from duplexpipe.launch.train_config import NONFINITE_POLICIES
from duplexpipe.launch.train_settings import merge_config
from duplexpipe.train.nonfinite import NONFINITE_GRADS
from duplexpipe.train.pipeline_config import PrecisionConfig, SafetyConfig
from duplexpipe.train.trainer import Pipeline, PipelineConfig

ROOT = Path(__file__).resolve().parents[2]
BAD_STEP = 2
CASES = [("skip", "fp32"), ("skip", "bf16"), ("raise", "fp32"), ("raise", "bf16")]


def _case(policy: str, precision: str) -> dict[str, Any]:
    """1F1B on 2 ranks; rank 1 turns a weight gradient NaN (fp32) or inf (bf16) on step BAD_STEP."""
    pipe = Pipeline(make_parts(2), mse, adam, PipelineConfig("1f1b", 4, precision=PrecisionConfig(dtype=precision),
                                                             safety=SafetyConfig(nonfinite_grads=policy)))
    state = {"step": -1}
    bad = math.nan if precision == "fp32" else math.inf
    if dist.get_rank() == 1:
        weight = next(pipe.stage_modules[1].parameters())
        weight.register_hook(lambda g: torch.full_like(g, bad) if state["step"] == BAD_STEP else g)
    out: dict[str, Any] = {"skipped": [], "norms": [], "changed": [], "losses": []}
    for step in range(4):
        state["step"] = step
        before = [p.detach().clone() for p in pipe.params]
        try:
            out["losses"].append(pipe.step(*batch(step)))
        except NonFiniteGradientError as exc:
            out["error"] = str(exc)
            out["kept"] = all(torch.equal(a, p) for a, p in zip(before, pipe.params, strict=True))
            break
        assert pipe.last is not None
        out["skipped"].append(pipe.last.skipped)
        out["norms"].append(pipe.last.grad_norm)
        out["changed"].append(any(not torch.equal(a, p) for a, p in zip(before, pipe.params, strict=True)))
    out["skipped_steps"] = pipe.skipped_steps
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {case: _case(*case) for case in CASES}


@pytest.fixture(scope="module")
def results() -> list[dict[Any, Any]]:
    return run_workers(_worker, 2, timeout_s=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_skip_skips_the_step_on_every_rank_counts_it_and_logs_the_true_norm(results: Any, precision: str) -> None:
    for res in results:
        got = res[("skip", precision)]
        assert got["skipped"] == [s == BAD_STEP for s in range(4)] and got["skipped_steps"] == 1
        assert got["changed"] == [s != BAD_STEP for s in range(4)], "a skipped step leaves the weights"
        norm = got["norms"][BAD_STEP]
        assert norm is not None and not math.isfinite(norm), "the norm is never a masked number"
        assert all(math.isfinite(n) and n > 0 for i, n in enumerate(got["norms"]) if i != BAD_STEP)
        assert all(math.isfinite(v) for v in got["losses"])
    assert [repr(n) for n in results[0][("skip", precision)]["norms"]] == \
        [repr(n) for n in results[1][("skip", precision)]["norms"]], "every rank saw the same norms"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_raise_stops_every_rank_naming_the_step_and_parameter(results: Any, precision: str) -> None:
    kind = "nan" if precision == "fp32" else "inf"
    messages = {res[("raise", precision)]["error"] for res in results}
    assert len(messages) == 1, messages  # one error, the same on every rank
    message = messages.pop()
    assert message.startswith(f"step {BAD_STEP + 1}: non-finite gradients, the first in stage 1, parameter "
                              f"'layer4.0.weight' (rank 1) holds {kind}; gradient norm "), message
    assert "The optimizer did not step" in message
    for res in results:
        got = res[("raise", precision)]
        assert got["kept"] and len(got["losses"]) == BAD_STEP, "the failing step changed no weight"


@pytest.mark.timeout(120)
def test_duplexpipe_train_exits_1_naming_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    task = f"{ROOT / 'tests' / '_bad_tasks.py'}:nan_grads"
    code = cli_main(["train", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--batch-size", "4",
                     "--steps", "2", "--log-every", "0", "--grad-clip-norm", "0", "--task", task])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    # every rank raises the same error: the launcher reports the first to arrive
    assert re.match(r"duplexpipe: error: rank [01] failed: NonFiniteGradientError: step 2: non-finite gradients, the "
                    r"first in stage 0, parameter 'layer0\.0\.weight' \(rank 0\) holds nan", err), err


@pytest.mark.timeout(120)
def test_duplexpipe_train_skip_goes_on_and_marks_the_step(tmp_path: Path) -> None:
    task = f"{ROOT / 'tests' / '_bad_tasks.py'}:nan_grads"
    code = cli_main(["train", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--batch-size", "4",
                     "--steps", "3", "--log-every", "0", "--precision", "bf16", "--nonfinite-grads", "skip",
                     "--no-tensorboard", "--task", task, "--out-dir", str(tmp_path)])
    assert code == 0  # rank 0 also prints "step 2/3 skipped: ..." (to the fork server's stdout: not captured here)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and [r.get("skipped", False) for r in rows] == [False, True, False]
    assert rows[1]["grad_norm"] is None, "NaN is written as null (JSON has no NaN), never as a masked number"
    assert all(r["grad_norm"] > 0 for r in (rows[0], rows[2]))


def test_the_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="SafetyConfig.nonfinite_grads must be one of raise, skip, got 'warn'"):
        PipelineConfig(safety=SafetyConfig(nonfinite_grads="warn"))
    assert PipelineConfig().safety.nonfinite_grads == "raise"
    assert NONFINITE_POLICIES == NONFINITE_GRADS  # `duplexpipe train --nonfinite-grads` offers the same choices
    assert merge_config({}, {"pipeline.safety.nonfinite_grads": "skip"}).pipeline.safety.nonfinite_grads == "skip"
    with pytest.raises(ValueError, match="nonfinite_grads must be one of raise, skip, got 'ignore'"):
        merge_config({}, {"pipeline.safety.nonfinite_grads": "ignore"})
