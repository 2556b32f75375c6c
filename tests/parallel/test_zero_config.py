"""Tests for duplexpipe.parallel.zero_config: ZeRO settings and bad combinations give a ValueError naming
the values (checked when PipelineConfig is built, before any process group is needed)."""

from __future__ import annotations

import pytest

from duplexpipe import PipelineConfig
from duplexpipe.dp_options.compression import Int8Options, NoCompression, compression_options
from duplexpipe.dp_options.zero import ZeroOptions, gradient_wire
from duplexpipe.parallel.zero_config import check_hpz, check_tied
from duplexpipe.schedules.registry import build
from duplexpipe.train.pipeline_config import DataParallelConfig


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"zero_stage": 4}, r"zero_stage must be one of \(0, 1, 2, 3\), got 4"),
    ({"zero_stage": "1"}, r"zero_stage must be one of \(0, 1, 2, 3\), got '1'"),
    ({"zero_stage": True}, r"zero_stage must be one of \(0, 1, 2, 3\), got True"),
    ({"zero_stage": 1, "grad_compression": "topk"}, "gradient compression 'topk' cannot be combined with ZeRO"),
    ({"zero_stage": 2, "grad_compression": "dgc"}, "gradient compression 'dgc' cannot be combined with ZeRO"),
    ({"zero_stage": 1, "grad_compression": "powersgd"}, "'powersgd' cannot be combined with ZeRO"),
    ({"zero_stage": 1, "grad_compression": "randomk"}, "'randomk' cannot be combined with ZeRO"),
    ({"zero_stage": 1, "grad_compression": "int4"}, "unknown gradient compression 'int4'"),
    ({"zero_stage": 1, "grad_compression": "bf16", "zero": ZeroOptions(quantized_gradients=True)},
     "quantized_gradients=True and grad_compression='bf16' both say"),
    ({"zero_stage": 0, "zero": ZeroOptions(quantized_weights=True)}, "need zero_stage 1, 2 or 3, got zero_stage=0"),
    ({"zero_stage": 1, "zero": ZeroOptions(hpz_ranks=2)}, "hpz_ranks=2 .* needs zero_stage=2 or 3 .*got zero_stage=1"),
    ({"zero_stage": 1, "dp_strategy": "replicated"}, "leave dp_strategy None \\(got 'replicated'\\)"),
    ({"zero_stage": 2, "zero": "qgz"}, "zero must be a ZeroOptions, got 'qgz'"),
])
def test_bad_zero_settings_name_the_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(data_parallel=DataParallelConfig(**kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"quantized_gradients": "int8"}, "quantized_gradients must be a bool or comm.Int8Options, got 'int8'"),
    ({"quantized_weights": 8}, "quantized_weights must be a bool or comm.Int8Options, got 8"),
    ({"hpz_ranks": 1}, "hpz_ranks must be an int >= 2 or None, got 1"),
    ({"trust_elementwise": "yes"}, "trust_elementwise must be a bool, got 'yes'"),
])
def test_bad_zero_options_name_the_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ZeroOptions(**kwargs)  # type: ignore[arg-type]


def test_the_gradient_wire_comes_from_grad_compression_or_qgz() -> None:
    assert gradient_wire(1, ZeroOptions(), NoCompression()) == NoCompression()
    assert gradient_wire(2, ZeroOptions(), compression_options("bf16")).method == "bf16"
    assert gradient_wire(1, ZeroOptions(), compression_options("int8")) == Int8Options()  # int8 = qgZ
    assert gradient_wire(1, ZeroOptions(quantized_gradients=True), NoCompression()) == Int8Options()
    mine = Int8Options(block=64, stochastic=False)
    assert gradient_wire(1, ZeroOptions(quantized_gradients=mine), mine) == mine  # the same twice is fine
    assert ZeroOptions(quantized_weights=True).weight_wire == Int8Options(stochastic=False)
    assert ZeroOptions().weight_wire is None
    for stage in (1, 2):
        PipelineConfig(data_parallel=DataParallelConfig(zero_stage=stage, grad_compression="fp16",
                                                        zero=ZeroOptions(quantized_weights=True)))


def test_hpz_needs_whole_nodes_and_a_schedule_without_split_backward() -> None:
    hpz = ZeroOptions(hpz_ranks=2)
    check_hpz(hpz, build("1f1b", 2, 4), 4)
    check_hpz(hpz, build("gpipe", 2, 4), 4)
    with pytest.raises(ValueError, match="hpz_ranks=2 must divide the data-parallel size 3"):
        check_hpz(hpz, build("1f1b", 2, 4), 3)
    with pytest.raises(ValueError, match="hpz_ranks=2 must divide the data-parallel size 2 and be smaller"):
        check_hpz(hpz, build("1f1b", 2, 4), 2)
    for name in ("zb-h1", "dualpipe", "zbv"):
        with pytest.raises(ValueError, match=f"{name!r} runs \\['I', 'W'\\]"):
            check_hpz(hpz, build(name, 2, 4), 4)


def test_tied_parameters_with_zero_and_data_parallelism_are_refused_by_name() -> None:
    tied = [((0, "wte.weight"), (1, "lm_head.weight"))]
    with pytest.raises(ValueError, match=r"zero_stage=1 does not support .*\['part 0 wte.weight\+part 1 "
                                         r"lm_head.weight'\]"):
        check_tied(1, tied, dp_size=2)
    check_tied(0, tied, dp_size=2)  # the replicated strategy sums tied gradients
    check_tied(2, tied, dp_size=1)  # DP=1 falls back to the replicated strategy
    check_tied(2, [], dp_size=2)
