"""Compiled stages with inductor on 2 gloo ranks (float64, 3 AdamW steps) against one eager process: every schedule
with PipelineConfig(compile=True), whole parts the user compiled, activation checkpointing; and a run (aot_eager:
dynamo recompiles alike under every backend) whose batch changes size (an uneven last microbatch) and evaluates:
recompiled once, not every step. Float8 (torchao's Float8Linear, emulated) compiles with inductor on the CPU too:
ZB-H1's parameters stay within 1e-6 of torchao's single-process eager float8 training (inductor's fused kernels sum
in another order; the float8 casts take the same scales)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from _compile_cases import PARTS, Case, pipeline, reference, run
from models import make_batch

WORLD = 2
SPAWN_TIMEOUT_S = 570
INDUCTOR = {"backend": "inductor"}
CASES = {
    **{s: Case(s) for s in PARTS},
    "dualpipev parts compiled by the user": Case("dualpipev", "parts", INDUCTOR),
    "zb-h1 checkpointed": Case("zb-h1", checkpointing=True),
}
"""Every schedule compiled by the config, and parts the user compiled (layers the user compiled: aot_eager in
test_compile_schedules.py, on four schedules)."""
SIZES = (8, 7, 7, 6, 8)
"""The resizing run's batch sizes: 7 rows make microbatches of 2, 2, 2 and 1."""


def _resizing(world: int) -> dict[str, Any]:
    """ZB-H1 with activation checkpointing: steps of SIZES rows, then two evaluations; the graphs each call
    compiled."""
    from torch._dynamo.utils import counters

    case = Case("zb-h1", options={"backend": "aot_eager"}, rows=SIZES, checkpointing=True)
    pipe = pipeline(case, world)
    losses, graphs = [], []
    for step, rows in enumerate(SIZES):
        before = counters["stats"]["unique_graphs"]
        losses.append(pipe.step(*make_batch(rows, step)))
        graphs.append(counters["stats"]["unique_graphs"] - before)
    for _ in range(2):
        before = counters["stats"]["unique_graphs"]
        pipe.evaluate(*make_batch(5, 99))
        graphs.append(counters["stats"]["unique_graphs"] - before)
    want = reference(case, world)
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)), "graphs": graphs}


def _float8(world: int) -> dict[str, Any]:
    """The float8 GPT under ZB-H1 compiled by inductor, each step against torchao's eager single process."""
    import _float8_cases as f8

    return f8.run(f8.build("zb-h1", (world, 1, 1), compile=INDUCTOR), f8.Reference())


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {name: run(case, world) for name, case in CASES.items()}
    out["resizing"] = _resizing(world)
    if importlib.util.find_spec("torchao") is not None:
        out["float8"] = _float8(world)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_with_inductor_equals_one_eager_process(results: list[dict[str, Any]], name: str) -> None:
    for rank in results:
        assert rank[name]["loss_err"] < 1e-9, (name, rank[name])
    if CASES[name].who == "config":
        assert all(rank[name]["compiled"] > 0 and not rank[name]["user"] for rank in results)
    else:
        assert all(rank[name]["compiled"] == 0 and rank[name]["user"] for rank in results)


def test_a_new_batch_size_and_evaluation_compile_once_not_every_step(results: list[dict[str, Any]]) -> None:
    for rank in results:
        resizing = rank["resizing"]
        assert resizing["loss_err"] < 1e-9, resizing
        graphs = resizing["graphs"]  # steps of 8, 7, 7, 6, 8 rows; two evaluations
        assert graphs[2:5] == [0, 0, 0] and graphs[6] == 0, graphs


FLOAT8_BOUND = 1e-6
"""Relative, per parameter tensor: inductor's fused kernels round fp32 sums in another order than eager."""


def test_float8_compiled_with_inductor_equals_torchaos_eager_single_process(results: list[dict[str, Any]]) -> None:
    pytest.importorskip("torchao")
    for rank in results:
        got = rank["float8"]
        assert got["float8"] > 0 and max(got["errors"]) <= FLOAT8_BOUND, got
