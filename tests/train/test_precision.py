"""Tests for duplexpipe.train.precision: autocast dtypes, the loss scaler, fp16 overflow agreement."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _train_helpers import adam, batch, make_parts, mse

from duplexpipe.launch.processes import launch
from duplexpipe.train.pipeline_config import PrecisionConfig
from duplexpipe.train.precision import DynamicLossScaler, LossScaleConfig, autocast_dtype
from duplexpipe.train.trainer import Pipeline, PipelineConfig

INF_STEP = 3


def test_autocast_dtype() -> None:
    assert autocast_dtype("fp32") is None
    assert autocast_dtype("bf16") is torch.bfloat16
    assert autocast_dtype("fp16") is torch.float16
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        autocast_dtype("fp8")


def test_scaler_backs_off_and_grows() -> None:
    scaler = DynamicLossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2, min_scale=2.0))
    scaler.update(overflow=True)
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1
    scaler.update(overflow=False)
    assert scaler.scale == 4.0
    scaler.update(overflow=False)
    assert scaler.scale == 8.0 and scaler.good_steps == 0
    for _ in range(5):
        scaler.update(overflow=True)
    assert scaler.scale == 2.0
    clone = DynamicLossScaler()
    clone.load_state_dict(scaler.state_dict())
    assert clone.state_dict() == scaler.state_dict()


def test_disabled_scaler_stays_at_one_and_counts_skipped_steps() -> None:
    """fp32/bf16 with nonfinite_grads="skip": the scale stays 1, the skipped step is counted (and checkpointed)."""
    scaler = DynamicLossScaler(enabled=False)
    scaler.update(overflow=True)
    scaler.update(overflow=False)
    assert scaler.scale == 1.0 and scaler.skipped_steps == 1


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaleConfig(backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_interval must be >= 1, got 0"):
        LossScaleConfig(growth_interval=0)


def _fp16_with_injected_inf() -> dict[str, Any]:
    """1F1B on 2 ranks in fp16; rank 1 turns one weight gradient into inf on step INF_STEP."""
    parts = make_parts(2)
    scale = LossScaleConfig(init_scale=2.0**10, growth_interval=3)
    cfg = PipelineConfig("1f1b", 4, grad_clip_norm=1.0, precision=PrecisionConfig(dtype="fp16", loss_scale=scale))
    pipe = Pipeline(parts, mse, adam, cfg,
                    scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)))
    state = {"step": -1}
    if dist.get_rank() == 1:
        weight = next(pipe.stage_modules[1].parameters())
        weight.register_hook(lambda g: torch.full_like(g, math.inf) if state["step"] == INF_STEP else g)
    skipped, scales, changed, losses, lrs = [], [], [], [], []
    for step in range(7):
        state["step"] = step
        before = [p.detach().clone() for p in pipe.params]
        losses.append(pipe.step(*batch(step)))
        skipped.append(pipe.last.skipped)
        scales.append(pipe.scaler.scale)
        changed.append(any(not torch.equal(a, p) for a, p in zip(before, pipe.params, strict=True)))
        lrs.append(pipe.optimizer.param_groups[0]["lr"])
    return {"skipped": skipped, "scales": scales, "changed": changed, "losses": losses, "lrs": lrs}


@pytest.fixture(scope="module")
def fp16_results() -> list[dict[str, Any]]:
    return launch(_fp16_with_injected_inf, 2, timeout_s=120)


@pytest.mark.timeout(150)
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(fp16_results: list[dict[str, Any]]) -> None:
    expected_skips = [step == INF_STEP for step in range(7)]
    for res in fp16_results:
        assert res["skipped"] == expected_skips
        assert res["changed"] == [not s for s in expected_skips]
        # 1024, grows to 2048 after 3 clean steps, halves on the skip, then 3 clean steps grow it again
        assert res["scales"] == [1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 1024.0, 2048.0]
        assert all(math.isfinite(v) for v in res["losses"])
        # the LR scheduler steps after applied optimizer steps only: the skipped step leaves the lr alone
        applied = list(itertools.accumulate(not s for s in expected_skips))
        assert res["lrs"] == pytest.approx([1e-2 / (n + 1) for n in applied])
    assert fp16_results[0]["losses"] == fp16_results[1]["losses"]
