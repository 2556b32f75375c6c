"""Data-parallel model: the ZeRO and compression tables, the reduction's time and how much of it is exposed."""

from __future__ import annotations

import math

import pytest

from duplexpipe import PipelineConfig
from duplexpipe.dp_options.compression import METHOD_NAMES, PowerSGDOptions, TopKOptions
from duplexpipe.dp_options.zero import ZERO_STAGES as TRAINER_ZERO_STAGES
from duplexpipe.planner.dp_comm import (
    COMPRESSIONS,
    ZERO_STAGES,
    Link,
    compression,
    exposed_time,
    reduction_time,
    zero_stage,
)
from duplexpipe.train.pipeline_config import DataParallelConfig


def test_the_tables_hold_the_trainers_stages_and_methods() -> None:
    assert list(TRAINER_ZERO_STAGES) == [0, 1, 2, 3]
    assert list(ZERO_STAGES) == list(TRAINER_ZERO_STAGES)  # the planner models every stage the trainer runs
    for stage in ZERO_STAGES:  # the training side takes every stage the planner offers
        PipelineConfig(data_parallel=DataParallelConfig(zero_stage=stage))
    ratios = [c.wire_ratio for c in COMPRESSIONS.values()]
    assert list(COMPRESSIONS)[0] == "none" and ratios[0] == 1.0
    assert ratios == sorted(ratios), "methods are listed lightest (least compression) first"
    for name, method in COMPRESSIONS.items():  # keyed by the trainer's options, under the trainer's names
        assert method.options.method in METHOD_NAMES and name.split("(")[0] == method.options.method
        taken = PipelineConfig(data_parallel=DataParallelConfig(grad_compression=method.options))
        assert taken.data_parallel.grad_compression == method.options
        assert compression(method.options) is method and compression(name) is method
    assert list(COMPRESSIONS) == ["none", "bf16", "fp16", "int8", "powersgd", "powersgd(rank=1)", "dgc"]
    assert compression("PowerSGD") is compression(PowerSGDOptions(rank=4)), "the trainer's spelling, defaults"
    assert not ZERO_STAGES[0].shard_optimizer and ZERO_STAGES[1].shard_optimizer
    assert ZERO_STAGES[2].shard_gradients and not ZERO_STAGES[1].shard_gradients
    assert ZERO_STAGES[3].shard_params and not ZERO_STAGES[2].shard_params
    assert ZERO_STAGES[3].param_traffic == 0.0, "ZeRO-3's all-gathers are the schedule's UNSHARD actions"
    with pytest.raises(ValueError, match="unknown ZeRO stage 4; known stages: 0, 1, 2, 3"):
        zero_stage(4)
    with pytest.raises(ValueError, match="unknown compression 'zip'; known methods: none, bf16"):
        compression("zip")
    with pytest.raises(ValueError, match=r"unknown compression 'topk'.* no measured wire ratio"):
        compression("topk")
    for options in (TopKOptions(), PowerSGDOptions(rank=2)):  # the trainer runs them; the planner has no ratio
        unmeasured = compression(options)
        assert unmeasured.options == options and unmeasured.wire_ratio == 1.0 and "no measured" in unmeasured.note
    assert compression(PowerSGDOptions(rank=2)).name == "powersgd(rank=2)"


def test_reduction_time_of_ring_collectives() -> None:
    link = Link(bandwidth=100.0, latency=0.5)
    none, bf16 = compression("none"), compression("bf16")
    # all-reduce: 2 x (D-1)/D x bytes, 2 passes of D-1 messages
    assert reduction_time(1000, 1000, 4, zero_stage(0), none, link) == pytest.approx(15 + 2 * 3 * 0.5)
    assert reduction_time(1000, 1000, 4, zero_stage(0), bf16, link) == pytest.approx(7.5 + 3)
    # ZeRO: reduce-scatter of (compressed) gradients + all-gather of parameters
    assert reduction_time(1000, 1000, 4, zero_stage(1), none, link) == pytest.approx(15 + 3)
    assert reduction_time(1000, 1000, 4, zero_stage(2), bf16, link) == pytest.approx(0.75 * 1500 / 100 + 3)
    assert reduction_time(1000, 1000, 1, zero_stage(0), none, link) == 0.0
    assert reduction_time(1000, 1000, 8, zero_stage(0), none, Link()) == 0.0


def test_exposed_time_overlaps_each_last_backward_pass() -> None:
    # one bucket whose pass runs [4, 6): a 2-long reduction hides, a 3-long one shows 1
    assert exposed_time([(4.0, 6.0, 2.0)], 6.0) == 0.0
    assert exposed_time([(4.0, 6.0, 3.0)], 6.0) == pytest.approx(1.0)
    # buckets share the link: the second starts when the first is done
    assert exposed_time([(5.0, 6.0, 1.0), (1.0, 2.0, 3.0)], 6.0) == pytest.approx(0.0)
    assert exposed_time([(1.0, 2.0, 5.0), (5.0, 6.0, 1.0)], 6.0) == pytest.approx(1.0)
    assert exposed_time([], 3.0) == 0.0


def test_link_checks_its_values() -> None:
    assert Link(10.0, 1.0).time(20.0, 2) == pytest.approx(4.0)
    assert Link().time(1e12) == 0.0
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="bandwidth must be > 0"):
            Link(bandwidth=bad)
    with pytest.raises(ValueError, match="latency must be a finite number >= 0"):
        Link(latency=-1.0)


def test_the_planners_choice_is_the_adaptive_controllers_start() -> None:
    from duplexpipe.dp_options.compression import AdaptiveOptions, Bf16Options, Int8Options
    from duplexpipe.planner.dp_comm import adaptive_start

    ladder = AdaptiveOptions(ladder="none/bf16/int8(block=128)")
    assert adaptive_start(ladder, Int8Options(block=128)).start == "int8(block=128)"
    assert adaptive_start(ladder, Bf16Options()).start_rung == 1
    with pytest.raises(ValueError, match="the planner chose 'int8', which is not a rung"):
        adaptive_start(ladder, Int8Options())
