"""Float8 (emulated) compute through `Pipeline` on 4 gloo ranks, in one spawn: each step's parameters equal torchao's
own single-process float8 training of the same model on the same microbatches (float32 master weights, within 1e-6
relative) under 1F1B, ZB-H1, ZBV and DualPipeV; under ZB-H1 with activation checkpointing, compiled (aot_eager),
and with fp8 stage sends (against the single process with the sends' round trips at the same cuts); with
PP=2 x TP=2 (a GPT whose blocks alternate linears with and without biases: the plain TP styles on those with one,
torchao's float8 styles on the others; also under sequence parallelism); with ZeRO-2 and with ZeRO-3 (FSDP2, the
weights all-gathered in float8, cast before the all-gather with the scale of the whole weight: the same float8
weight as torchao's single-process cast, so the same bound). A float8 checkpoint resumes with float8 off and on.
torchao's float8 TP styles forced on linears with a bias differ from torchao's single process in the bias gradients
only (why they are kept off those)."""

from __future__ import annotations

from typing import Any

import pytest
from _float8_cases import SCHEDULES, STEPS, case

pytest.importorskip("torchao")
from duplexpipe.train.float8_tp import BIAS, GLOO  # noqa: E402 - needs torchao

WORLD = 4
SPAWN_TIMEOUT_S = 300
TOLERANCE = 1e-6
"""Relative, per parameter tensor: fp32 rounding of another summation order (TP's partial sums, DP's reduction)."""


def _worker(rank: int, world: int) -> dict[str, Any]:
    return case(rank, world)


@pytest.mark.parametrize("name", [*SCHEDULES, "zb-h1 checkpointed", "tp", "tp sequence parallel",
                                  "zero2", "zero3", "fp8 sends", "zb-h1 compiled"])
def test_each_step_equals_torchao_single_process(results: list[dict[str, Any]], name: str) -> None:
    for rank, out in enumerate(results):
        got = out[name]
        assert got["float8"] > 0, f"rank {rank} holds no float8 linear under {name}"
        assert len(got["errors"]) == STEPS and max(got["errors"]) <= TOLERANCE, (name, rank, got["errors"])


def test_zero3_gathers_the_float8_weights_in_float8(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        assert out["zero3"]["gathered"] == ["torch.float8_e4m3fn"], (rank, out["zero3"]["gathered"])


def test_a_float8_checkpoint_resumes_with_float8_off_and_on(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        resumed = out["resume"]
        assert resumed["names"], f"rank {rank}: parameter names differ with float8 off"
        assert resumed["off"] == 0.0 and resumed["on"] == 0.0, (rank, resumed)


LINEARS = 6
"""Linears per GPT block that the plan shards: q, k, v and the MLP's first by columns, proj and the MLP's last by rows
(each pipeline stage of PP=2 x TP=2 holds 4 blocks: 2 whose linears have a bias, 2 without)."""
COLUMNS = 4


@pytest.mark.parametrize(("name", "styles"), [
    ("tp", {"float8": 2 * LINEARS, BIAS: 2 * LINEARS}),
    ("tp sequence parallel", {"float8": 2 * COLUMNS, GLOO: 2 * (LINEARS - COLUMNS), BIAS: 2 * LINEARS}),
])
def test_torchaos_float8_tp_styles_where_they_are_torchaos_math(results: list[dict[str, Any]], name: str,
                                                                styles: dict[str, int]) -> None:
    for rank, out in enumerate(results):
        assert out[name]["styles"] == styles, (rank, out[name]["styles"])


def test_torchaos_float8_tp_styles_on_a_bias_change_only_the_bias_gradients(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        worst = out["biased block"]
        assert worst["weights"] <= TOLERANCE and worst["biases"] > 1e-3, (rank, worst)
