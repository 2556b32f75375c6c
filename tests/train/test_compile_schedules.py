"""Compiled stages on 4 gloo ranks (float64, 3 AdamW steps, aot_eager: the breadth) against one eager process:
every schedule with PipelineConfig(compile=...), with layers and with whole parts the user compiled, with
activation checkpointing (tensor and expert parallelism: test_compile_parallel.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _compile_cases import PARTS, Case, run

WORLD = 4
SPAWN_TIMEOUT_S = 570
EAGER_AOT = {"backend": "aot_eager"}
CASES = {
    **{f"{s} config": Case(s, "config", EAGER_AOT) for s in PARTS},
    **{f"{s} layers": Case(s, "layers", EAGER_AOT) for s in ("1f1b", "zb-h2", "dualpipe", "zbv")},
    "zb-h1 parts": Case("zb-h1", "parts", EAGER_AOT),
    **{f"{s} checkpointed": Case(s, "config", EAGER_AOT, checkpointing=True) for s in ("zbv", "dualpipe")},
}


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: run(case, world) for name, case in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_equals_one_eager_process(results: list[dict[str, Any]], name: str) -> None:
    for rank in results:
        assert rank[name]["loss_err"] < 1e-9, (name, rank[name])
        assert (rank[name]["compiled"] > 0) == (CASES[name].who == "config"), rank[name]
