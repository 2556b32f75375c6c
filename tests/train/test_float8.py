"""Tests for duplexpipe.train.float8 and train.float8_linear: the options and their errors (recipe, torchao version,
hardware), which linears convert (and that their names do not change), and the split backward: I forms d(input) and W
d(weight), each GEMM once, equal to torchao's unsplit backward."""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import logging

import pytest
import torch
from _counting import CountMatmuls
from torch import nn
from torch.autograd.graph import get_gradient_edge

from duplexpipe.cli import main as cli_main
from duplexpipe.launch import train_loop
from duplexpipe.moe.layer import MoELayer
from duplexpipe.runtime.backward.graph import stage_backward_input, stage_backward_weight
from duplexpipe.train import float8
from duplexpipe.train.float8 import Float8Options, convert_stages, float8_options
from duplexpipe.train.pipeline_config import PipelineConfig, PrecisionConfig

torchao = pytest.importorskip("torchao")
CPU = torch.device("cpu")


def test_options_from_names_labels_and_objects() -> None:
    assert float8_options(None) is None
    assert float8_options("tensorwise") == Float8Options("tensorwise")
    assert float8_options("rowwise(emulate=true)") == Float8Options("rowwise", emulate=True)
    assert float8_options(Float8Options("rowwise")) == Float8Options("rowwise")
    assert PipelineConfig(precision=PrecisionConfig(float8="tensorwise")).precision.float8 == "tensorwise"


def test_zero3_gathers_in_float8_by_default_with_the_tensorwise_recipe_only() -> None:
    assert float8_options("tensorwise(fsdp_all_gather=false)") == Float8Options(fsdp_all_gather=False)
    assert [Float8Options().all_gathers_float8(z) for z in (0, 1, 2, 3)] == [False, False, False, True]
    assert not Float8Options("rowwise").all_gathers_float8(3)
    assert not Float8Options(fsdp_all_gather=False).all_gathers_float8(3)
    assert not Float8Options(fsdp_all_gather=True).all_gathers_float8(2)  # only ZeRO-3 gathers weights
    assert float8.linear_config(Float8Options(), True, 3).enable_fsdp_float8_all_gather
    assert not float8.linear_config(Float8Options(), True, 2).enable_fsdp_float8_all_gather


@pytest.mark.parametrize(("spec", "words"), [("blockwise", "'blockwise'"), ("rowwise(scale=2)", "scale"),
                                             ("tensorwise(emulate=3)", "emulate"), (8, "8"),
                                             ("tensorwise(fsdp_all_gather=1)", "fsdp_all_gather"),
                                             ("rowwise(fsdp_all_gather=true)", "'rowwise'")])
def test_bad_options_name_the_value(spec: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        PrecisionConfig(float8=spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(("version", "fits"), [("0.18.0", True), ("0.18.2+cu128", True), ("0.17.1", False),
                                               ("0.19.0", False), ("1.0.0", False)])
def test_the_torchao_range(version: str, fits: bool) -> None:
    assert float8.supported_version(version) is fits


def test_a_torchao_out_of_range_or_missing_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda _name: "0.12.0")
    with pytest.raises(ValueError, match=r"torchao >=0\.18,<0\.19; the installed torchao is 0\.12\.0"):
        convert_stages({0: nn.Linear(16, 16)}, Float8Options(), CPU)

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ValueError, match="torchao is not installed"):
        float8.check_torchao()


def test_emulation_where_there_is_no_fp8_hardware_and_an_error_when_it_is_refused() -> None:
    assert float8.resolve_emulate(Float8Options("rowwise"), CPU) is True
    with pytest.raises(ValueError, match=r"'rowwise' with emulate=False .* device cpu"):
        float8.resolve_emulate(Float8Options("rowwise", emulate=False), CPU)
    module = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="device cpu"):
        convert_stages({0: module}, Float8Options("tensorwise", emulate=False), CPU)
    assert type(module[0]) is nn.Linear  # refused before anything changed


class _Model(nn.Module):
    """Linears of every kind the filter decides on."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.odd = nn.Linear(64, 24)
        self.down = nn.Linear(24, 16)
        self.moe = MoELayer(16, 32, num_experts=2, top_k=1, shared_experts=1)
        self.head = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32))


def test_which_linears_convert_and_the_names_stay(caplog: pytest.LogCaptureFixture) -> None:
    model = _Model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="duplexpipe.float8"):
        converted = convert_stages({3: model}, Float8Options(), CPU)
    assert converted == ["3.up"]
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[n], before[n]) for n in before)
    assert all(t.dtype == torch.float32 for t in after.values())
    (line,) = [r.getMessage() for r in caplog.records]
    assert "emulated: no FP8 GEMMs on cpu" in line and "1 linears converted" in line
    assert "MoE experts and routers" in line and "output projections" in line and "not divisible by 16" in line
    assert "ZeRO-3" not in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="duplexpipe.float8"):
        convert_stages({3: _Model()}, Float8Options(), CPU, zero_stage=3)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "ZeRO-3 all-gathers them in float8" in line


def _models(recipe: str) -> tuple[nn.Module, nn.Module]:
    """(ours: SplitFloat8Linear, torchao's own convert_to_float8_training) of one model."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32, bias=False), nn.Tanh(), nn.Linear(32, 16))
    theirs = copy.deepcopy(model)
    convert_stages({0: model}, Float8Options(recipe), CPU)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(theirs, config=config)
    return model, theirs


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_the_split_backward_is_torchaos_backward_each_gemm_once(recipe: str) -> None:
    ours, theirs = _models(recipe)
    x = torch.randn(4, 8, 32)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    assert torch.equal(y_ours, y_theirs)
    grad = torch.randn_like(y_ours)
    with CountMatmuls() as unsplit:
        y_theirs.backward(grad)
    params = list(ours.parameters())
    with CountMatmuls() as at_i:
        (d_input,), groups = stage_backward_input([get_gradient_edge(y_ours)], [grad], [x_ours], params)
    assert all(p.grad is None for p in params)  # nothing of W ran at I
    with CountMatmuls() as at_w:
        stage_backward_weight(groups)
    assert (at_i.count, at_w.count, unsplit.count) == (3, 3, 6)  # one GEMM per linear at I, one at W
    assert d_input is not None and torch.equal(d_input, x_theirs.grad)
    for (name, mine), theirs_p in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert mine.grad is not None and torch.equal(mine.grad, theirs_p.grad), name


def test_a_full_backward_is_torchaos_and_float8_is_not_fp32() -> None:
    ours, theirs = _models("tensorwise")
    plain = nn.Sequential(*(nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
                            if isinstance(m, nn.Linear) else m for m in theirs))
    plain.load_state_dict(theirs.state_dict())
    x = torch.randn(16, 32)
    for model in (ours, theirs, plain):
        model(x).square().sum().backward()
    for a, b, c in zip(ours.parameters(), theirs.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and c.grad is not None
        assert torch.equal(a.grad, b.grad)
        assert (a.grad - c.grad).abs().max() > 1e-4 * c.grad.abs().max()  # float8 rounding shows: a test can fail


@pytest.mark.parametrize(("value", "needle"), [
    ("blockwise", "PrecisionConfig.float8 must be None, one of ('tensorwise', 'rowwise')"),
    ("rowwise(emulate=false)", "float8 recipe 'rowwise' with emulate=False needs FP8 GEMMs"),
])
def test_the_command_line_refuses_in_one_line_before_any_process(value: str, needle: str,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available() and "emulate" in value:
        pytest.skip("this machine may have FP8 GEMMs")
    monkeypatch.setattr(train_loop, "run_training", lambda *_: pytest.fail("a process was started"))
    assert cli_main(["train", "--float8", value, "--steps", "1", "--task-option", "n_layer=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("duplexpipe: error: ") and needle in err and err.count("\n") == 1, err
