"""SavedBytes: what a forward keeps for backward, and the runtime's measured peak of it against the byte model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from duplexpipe.runtime.saved_bytes import SavedBytes, storage_key
from duplexpipe.train.pipeline_config import ObserveConfig


def test_linear_keeps_its_input_but_not_its_weight() -> None:
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedBytes(layer.parameters())
    with meter.counting():
        layer(x)
    assert meter.total == 4 * 8 * 4  # the input; weight.t() is a view of a parameter


def test_live_parameters_are_read_at_each_forward_as_fsdp_swaps_them() -> None:
    """A parameter swapped onto the module after the meter was made (FSDP2's gathered weight) is not counted when
    `live` names the module's parameters at the forward, and is without it."""
    layer = nn.Linear(8, 8)
    fixed, live = SavedBytes(layer.parameters()), SavedBytes(layer.parameters(), live=layer.parameters)
    layer.weight = nn.Parameter(layer.weight.detach().clone())  # a new storage, as an all-gather's output
    x = torch.randn(4, 8, requires_grad=True)
    for meter in (fixed, live):
        meter.start()
        with meter.counting():
            layer(x)
    assert live.total == 4 * 8 * 4 and fixed.total == live.total + 8 * 8 * 4  # the input; + the swapped weight


def test_relu_output_adds_and_reset_starts_over() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    meter = SavedBytes(model.parameters())
    with meter.counting():
        model(torch.randn(4, 8, requires_grad=True))
    assert meter.total == 2 * 128
    meter.reset()
    assert meter.total == 0
    with meter.counting():
        model(torch.randn(2, 8, requires_grad=True))
    assert meter.total == 2 * 64


def test_a_storage_saved_twice_or_through_a_view_counts_once_and_whole() -> None:
    x = torch.randn(16, requires_grad=True)
    base = x * 1.0  # a fresh 64-byte storage
    meter = SavedBytes()
    with meter.counting():
        (base * base).sum()  # saves `base` twice
        (base[:4] * 2.0 * base[:4]).sum()  # saves views of `base`, and one fresh 16-byte tensor
    assert meter.total == 64 + 16


def test_nothing_is_counted_outside_the_block_and_the_innermost_hooks_count() -> None:
    meter, outer = SavedBytes(), SavedBytes()
    x = torch.randn(8, requires_grad=True)
    (x * x).sum()
    with outer.counting(), meter.counting():
        (x.exp()).sum()
    assert meter.total == 32 and outer.total == 0
    assert storage_key(x)[1] == 32


def test_start_counts_kept_leaves_once_and_never_the_callers_data() -> None:
    data, weight = torch.randn(4, 8), nn.Parameter(torch.ones(8))
    leaf = torch.randn(4, 8, requires_grad=True)
    meter = SavedBytes([weight])
    meter.start(kept=[leaf], data=[data])
    with meter.counting():
        (data * weight).sum()  # saves `data` (the caller's) and `weight` (a parameter): nothing counted
        (leaf * weight).sum()  # saves `leaf`, already counted as kept
    assert meter.total == 4 * 8 * 4
    meter.start()
    assert meter.total == 0
    with meter.counting():
        (data * weight).sum()
    assert meter.total == 4 * 8 * 4, "start() forgets the data of the previous count"


def test_saved_tensors_still_give_the_right_gradients() -> None:
    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedBytes(layer.parameters())
    with meter.counting():
        out = layer(x).sum()
    out.backward()
    expected = torch.autograd.grad(layer(x).sum(), x)[0]
    assert x.grad is not None and torch.equal(x.grad, expected)


# ----------------------------------------------------------------- the runtime's measured peak, 2 ranks
WORLD = 2
BATCH, WIDTH, M = 16, 8, 4
ROWS = BATCH // M
SAVED = (ROWS * WIDTH * 4, 2 * ROWS * WIDTH * 4)
"""By hand, per microbatch: stage 0 keeps ReLU's output (Linear saves the batch, which is the caller's);
stage 1 keeps its input leaf (also what Linear saves) and ReLU's output (the loss saves that and the target)."""


def _product_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out * target).mean()


def _measure(schedule: str, count: bool) -> dict[str, Any]:
    from duplexpipe import Pipeline, PipelineConfig, profile_parts
    from duplexpipe.planner.memory import StageBytes, rank_memory
    from duplexpipe.schedules.simulate import CostModel, simulate

    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(2)]
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    pipe = Pipeline(parts, _product_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                    PipelineConfig(schedule=schedule, num_microbatches=M,
                                   observe=ObserveConfig(count_saved_bytes=count)))
    measured = []
    for _ in range(2):
        pipe.step(x, y)
        assert pipe.last is not None
        measured.append(pipe.last.peak_saved_bytes)
    profile = profile_parts(parts, x[:ROWS], target=y[:ROWS], loss_fn=_product_loss, repeats=1, warmup=0)
    sched = pipe.schedule
    model = rank_memory(sched, simulate(sched, CostModel()), StageBytes.of(sched, profile.parts))
    return {"measured": measured, "predicted": model[dist.get_rank()].activations,
            "profiled": [p.activation_bytes for p in profile.parts]}


def _worker(rank: int, world: int) -> dict[str, Any]:
    return {"1f1b": _measure("1f1b", True), "zb-h1": _measure("zb-h1", True), "off": _measure("1f1b", False)}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_runtimes_peak_equals_the_byte_models_prediction(results: list[dict[str, Any]], schedule: str) -> None:
    for rank, result in enumerate(results):
        case = result[schedule]
        assert case["profiled"] == list(SAVED), "the profile counts what a hand count gives"
        assert case["measured"] == [case["predicted"]] * 2, f"rank {rank}: every step's peak is the prediction"
    if schedule == "1f1b":  # rank 0 holds P = 2 microbatches of stage 0, rank 1 one of stage 1
        assert [r[schedule]["measured"][0] for r in results] == [2 * SAVED[0], SAVED[1]]


def test_with_counting_off_nothing_is_reported(results: list[dict[str, Any]]) -> None:
    assert all(r["off"]["measured"] == [0, 0] for r in results)
