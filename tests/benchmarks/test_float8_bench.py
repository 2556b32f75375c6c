"""benchmarks.float8_bench: the report's loss verdict against bf16 and its speed verdict (said not measured without a
GPU with FP8 GEMMs, naming the model it would be measured on); the GPU speed run's setup (its GEMM-bound model and
configs, and its worker at toy size on the CPU). The measuring run is the part's own:
`python -m benchmarks.float8_bench --quick`."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import torch

from benchmarks import float8_bench
from benchmarks.framework import render
from duplexpipe.launch.tasks.gpt import GPTConfig


def _result(float8_loss: float, speed: dict[str, Any]) -> dict[str, Any]:
    rows = {name: {"loss_last": loss, "losses": [loss], "tokens_per_s": 1000.0}
            for name, loss in (("fp32", 2.0), ("bf16", 2.0), ("float8", float8_loss))}
    return {"rows": rows, "loss_ratio": float8_loss / 2.0, "loss_ratio_fp32": float8_loss / 2.0, "speed": speed,
            "device": "cpu", "config": asdict(float8_bench.QUICK)}


def test_the_loss_verdict_and_the_speed_verdict() -> None:
    model = float8_bench.SPEED.model()
    text = render(float8_bench.report(_result(2.02, {"ratio": None, "why": "no GPU", "model": model})),
                  markdown=False)
    assert "Final loss float8 / bf16: 1.0100" in text and "target within 2%: yes" in text
    said = f"GPU tokens/s float8 / bf16 was not measured: no GPU (on an H100 or newer this part measures it on {model}"
    assert said in text
    assert "target >= 1.2x" in text
    measured = {"ratio": 1.31, "tokens_per_s": {"bf16": 1000.0, "float8": 1310.0}, "model": model,
                "device": "NVIDIA H100"}
    text = render(float8_bench.report(_result(2.1, measured)), markdown=False)
    assert "target within 2%: no" in text and f"on NVIDIA H100, {model}: 1.31x" in text
    assert "(1,310 / 1,000; target >= 1.2x: yes)" in text


def test_without_a_gpu_the_speed_is_not_measured_and_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    verdict = float8_bench.speed_verdict()
    assert verdict == {"ratio": None, "why": "this machine has no CUDA GPU", "model": float8_bench.SPEED.model()}


def test_the_gpu_speed_run_is_gemm_bound_and_its_setup_runs_on_the_cpu() -> None:
    cfg = float8_bench.Float8BenchConfig().speed()
    assert cfg == float8_bench.SPEED and cfg.d_model // cfg.n_head == float8_bench.HEAD_DIM
    assert float8_bench.QUICK.speed().d_model < cfg.d_model  # --quick's speed run is a toy
    GPTConfig(d_model=cfg.d_model, n_head=cfg.n_head, n_layer=cfg.n_layer)  # a valid GPT
    tokens = cfg.batch_size * float8_bench.SEQ // cfg.microbatches
    assert tokens >= cfg.d_model >= 4096  # each GEMM's three sides at least 4096: compute-bound on an H100
    assert "d_model 4096 (805M block parameters), 8,192 tokens per microbatch" in cfg.model()
    configs = float8_bench.speed_configs(cfg)
    assert [c.precision.float8 for c in configs.values()] == [None, "tensorwise"]
    assert all(c.precision.dtype == "bf16" and c.compile for c in configs.values())
    rates = float8_bench.measure_speed(float8_bench.DRY_SPEED, "gloo")  # the worker at toy size, emulated
    assert sorted(rates) == ["bf16", "float8"] and all(r > 0 for r in rates.values())
