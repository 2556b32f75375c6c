"""Tests for duplexpipe.train.checkpoint.pipeline: resumed training repeats the uninterrupted run exactly, on the same
layout and on another one (schedule, pipeline size, partition, DP size, ZeRO stage: ZeRO-3 to ZeRO-1 / ZeRO-0 and
back); format-1 checkpoints refused; bad names."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _train_helpers import WIDTH, adam, batch, make_parts, mse
from torch import nn
from torch.distributed.tensor import DTensor

from duplexpipe.launch.processes import launch
from duplexpipe.launch.train_config import lr_factor
from duplexpipe.parallel.mesh import make_mesh
from duplexpipe.train.checkpoint import read_checkpoint, state_keys
from duplexpipe.train.checkpoint.pipeline import rng_state, stage_dict
from duplexpipe.train.pipeline_config import DataParallelConfig
from duplexpipe.train.trainer import Pipeline, PipelineConfig

TOTAL, SAVE_AT = 8, 5
MOVE_AT, MOVED = 3, 6
"""Portability: save after MOVE_AT steps in one layout, continue to MOVED in another."""


def _warmup_cosine(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_factor("cosine", 3, TOTAL, 0.1))


def _build(schedule: str, microbatches: int, seed: int, dp: int = 1, blocks: int = 8,
           scheduler: bool = False) -> Pipeline:
    pp = dist.get_world_size() // dp
    cfg = PipelineConfig(schedule, microbatches, grad_clip_norm=0.2)
    num_parts = blocks if schedule == "dualpipev" else pp
    mesh = make_mesh(pp, dp) if dp > 1 else None
    return Pipeline(make_parts(num_parts, blocks, seed), mse, adam, cfg, mesh=mesh,
                    scheduler=_warmup_cosine if scheduler else None)


def _local(pipe: Pipeline, step: int) -> tuple[Any, Any]:
    x, y = batch(step)
    half = 16 // pipe.groups.dp_size
    lo = pipe.groups.dp_rank * half
    return x[lo:lo + half], y[lo:lo + half]


def _resume_case(root: str, name: str, schedule: str, microbatches: int, save_at: int,
                 dp: int = 1, scheduler: bool = False) -> dict[str, Any]:
    path = str(Path(root) / name)
    first = _build(schedule, microbatches, seed=0, dp=dp, scheduler=scheduler)
    straight, lrs = [], []
    for step in range(TOTAL):
        if step == save_at:
            first.save(path)
        straight.append(first.step(*_local(first, step)))
        lrs.append(first.optimizer.param_groups[0]["lr"])
    resumed = _build(schedule, microbatches, seed=1, dp=dp, scheduler=scheduler)  # different weights until loaded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load(path)
    tail, tail_lrs = [], []
    for step in range(save_at, TOTAL):
        tail.append(resumed.step(*_local(resumed, step)))
        tail_lrs.append(resumed.optimizer.param_groups[0]["lr"])
    return {"straight": straight[save_at:], "resumed": tail, "calls": resumed.calls,
            "lrs": lrs[save_at:], "resumed_lrs": tail_lrs, "warnings": [str(w.message) for w in caught]}


def _error(load: Any) -> str:
    try:
        load()
    except ValueError as exc:
        return str(exc)
    return ""


# ---- portability: float64, another layout continues exactly ----

def _mse64(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target.to(out.dtype))


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _layout(schedule: str, pp: int, dp: int, zero: int = 0, compression: str | None = None,
            window: int | None = None) -> Pipeline:
    """An 8-block float64 model split for `schedule` on pp ranks x dp replicas (the parts' count sets the split);
    `window`: ZeRO-3's reshard window."""
    from duplexpipe.schedules.registry import build

    microbatches = 2 * pp if schedule == "dualpipe" else 4
    parts = [p.double() for p in make_parts(build(schedule, pp, microbatches).num_groups, 8, seed=0)]
    cfg = PipelineConfig(schedule, microbatches, data_parallel=DataParallelConfig(
        zero_stage=zero, grad_compression=compression, reshard_window=window))
    return Pipeline(parts, _mse64, _adamw, cfg, mesh=make_mesh(pp, dp) if dp > 1 else None)


def _batch64(pipe: Pipeline, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _local(pipe, step)
    return x.double(), y.double()


def _weights(pipe: Pipeline) -> dict[str, torch.Tensor]:
    """This rank's parameters by their global names (first copies)."""
    keys = state_keys(pipe)
    out = {}
    for stage, module in sorted(pipe.stage_state_modules.items()):
        for local, param in module.named_parameters():
            whole = param.full_tensor() if isinstance(param, DTensor) else param  # ZeRO-2/3: gathered (collective)
            out[keys.names[f"stage{stage}.{local}"]] = whole.detach().clone()
    return out


def _move_case(root: str, name: str, before: tuple[Any, ...], after: tuple[Any, ...]) -> dict[str, Any]:
    """`before` layout: MOVED straight steps, saving at MOVE_AT; `after` layout loads it and runs the rest."""
    path = str(Path(root) / name)
    first = _layout(*before)
    straight = []
    for step in range(MOVED):
        if step == MOVE_AT:
            first.save(path)
        straight.append(first.step(*_batch64(first, step)))
    second = _layout(*after)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second.load(path)
    tail = [second.step(*_batch64(second, step)) for step in range(MOVE_AT, MOVED)]
    return {"straight": straight[MOVE_AT:], "moved": tail, "straight_weights": _weights(first),
            "moved_weights": _weights(second), "warnings": [str(w.message) for w in caught],
            "strategies": (first.dp.name, second.dp.name)}


# ---- format 1 (stage-keyed), written as earlier versions wrote it: no longer read ----

def _save_format1(pipe: Pipeline, path: str) -> None:
    model, optim = pipe.dp.checkpoint_dicts(stage_dict(pipe))
    trainer = {"schedule": pipe.schedule.name, "num_stages": pipe.schedule.num_stages, "calls": pipe.calls,
               "optimizer_steps": pipe.optimizer_steps, "fresh_optimizer": False, "scaler": pipe.scaler.state_dict()}
    dcp.save({"model": model, "optim": optim, "trainer": trainer, "rng": rng_state()}, checkpoint_id=path)


def _format1_case(root: str) -> dict[str, Any]:
    path = str(Path(root) / "format1")
    first = _build("1f1b", 4, seed=0)
    for step in range(3):
        first.step(*batch(step))
    _save_format1(first, path)
    again = _build("1f1b", 4, seed=1)
    other = _build("dualpipe", 8, seed=0)
    return {"same": _error(lambda: again.load(path)), "other": _error(lambda: other.load(path)),
            "calls": again.calls}


def _all_cases(root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {
        "dualpipe": _resume_case(root, "dualpipe", "dualpipe", 8, SAVE_AT),
        "dualpipev": _resume_case(root, "dualpipev", "dualpipev", 8, SAVE_AT),
        "fresh": _resume_case(root, "fresh", "1f1b", 4, 0),
        "pp2xdp2": _resume_case(root, "pp2xdp2", "1f1b", 4, SAVE_AT, dp=2),
        "scheduler": _resume_case(root, "scheduler", "dualpipe", 8, SAVE_AT, scheduler=True),
        "1f1b4-zbv2x2z1": _move_case(root, "to-zbv", ("1f1b", 4, 1), ("zbv", 2, 2, 1)),
        "dualpipe4-1f1b2x2": _move_case(root, "to-1f1b", ("dualpipe", 4, 1), ("1f1b", 2, 2)),
        "int8-zbh1": _move_case(root, "int8", ("1f1b", 2, 2, 0, "int8"), ("zb-h1", 2, 2, 0, "int8")),
        "format1": _format1_case(root),
    }
    no_scheduler = _build("dualpipe", 8, seed=0)  # "scheduler" was saved with one
    out["no_scheduler"] = _error(lambda: no_scheduler.load(str(Path(root) / "scheduler")))
    six = _build("1f1b", 4, seed=0, blocks=6)  # "fresh" holds 8 blocks
    out["other_model"] = _error(lambda: six.load(str(Path(root) / "fresh")))
    out["not_a_checkpoint"] = _error(lambda: six.load(str(Path(root) / "nowhere")))
    return out


ZERO3_STRATEGIES = {"z3-1f1b2x2-z1-zbv2x2": ("zero3", "zero1"), "z3-zbv2x2w1-pp4": ("zero3", "replicated"),
                    "z1-zbv2x2-z3-dualpipev2x2w1": ("zero1", "zero3"), "pp4-z3-zbh1x2x2": ("replicated", "zero3")}
ZERO3_MOVES = {
    "z3-1f1b2x2-z1-zbv2x2": (("1f1b", 2, 2, 3), ("zbv", 2, 2, 1)),
    "z3-zbv2x2w1-pp4": (("zbv", 2, 2, 3, None, 1), ("1f1b", 4, 1)),
    "z1-zbv2x2-z3-dualpipev2x2w1": (("zbv", 2, 2, 1), ("dualpipev", 2, 2, 3, None, 1)),
    "pp4-z3-zbh1x2x2": (("1f1b", 4, 1), ("zb-h1", 2, 2, 3)),
}
"""ZeRO-3 (FSDP2's sharded DTensors) to ZeRO-1 (flat shards) and plain pipelines on other layouts, and back."""


def _zero3_cases(root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: _move_case(root, name, before, after) for name, (before, after) in ZERO3_MOVES.items()}


def _dropout_pipe() -> Pipeline:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(0.3)) for _ in range(2)]
    return Pipeline(blocks, mse, adam, PipelineConfig("dualpipe", 4))


def _dropout_straight(root: str) -> list[float]:
    """Dropout model: the uninterrupted run, saving at SAVE_AT."""
    pipe = _dropout_pipe()
    torch.manual_seed(100 + dist.get_rank())  # each rank its own dropout stream
    losses = []
    for step in range(TOTAL):
        if step == SAVE_AT:
            pipe.save(str(Path(root) / "dropout"))
        losses.append(pipe.step(*batch(step)))
    return losses[SAVE_AT:]


def _dropout_resumed(root: str) -> list[float]:
    """Fresh processes, a different RNG state until the checkpoint's is loaded."""
    pipe = _dropout_pipe()
    torch.manual_seed(999)
    pipe.load(str(Path(root) / "dropout"))
    return [pipe.step(*batch(step)) for step in range(SAVE_AT, TOTAL)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    out = launch(_all_cases, 4, (root,), timeout_s=300)
    straight = launch(_dropout_straight, 2, (root,), timeout_s=120)
    resumed = launch(_dropout_resumed, 2, (root,), timeout_s=120)
    out[0]["dropout"] = {"straight": straight, "resumed": resumed}
    out[0]["root"] = root
    return out


@pytest.fixture(scope="module")
def zero3_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_zero3_cases, 4, (str(tmp_path_factory.mktemp("ckpt-zero3")),), timeout_s=300)


@pytest.mark.timeout(600)
def test_dropout_model_resumes_exactly_in_fresh_processes(results: list[dict[str, Any]]) -> None:
    """The RNG state of every rank is in the checkpoint: dropout masks after resuming are the same."""
    got = results[0]["dropout"]
    for rank in range(2):
        assert len(got["resumed"][rank]) == TOTAL - SAVE_AT
        assert got["resumed"][rank] == got["straight"][rank], (rank, got)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["dualpipe", "dualpipev", "fresh", "pp2xdp2", "scheduler"])
def test_resume_continues_with_exactly_the_same_losses(results: list[dict[str, Any]], case: str) -> None:
    for res in results:
        got = res[case]
        assert got["resumed"] == got["straight"], got
        assert got["resumed_lrs"] == got["lrs"], got
        assert got["calls"] == TOTAL
        assert got["warnings"] == [], "the same layout restores everything: nothing to warn about"
    assert len(results[0][case]["resumed"]) == TOTAL - (0 if case == "fresh" else SAVE_AT)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["1f1b4-zbv2x2z1", "dualpipe4-1f1b2x2"])
def test_another_layout_continues_exactly(results: list[dict[str, Any]], case: str) -> None:
    """1F1B on 4 ranks -> ZBV on 2 ranks x DP 2 with ZeRO-1; DualPipe (4 parts) -> 1F1B x DP 2 (2 parts): float64
    losses and every weight within 1e-12 of the run that never changed layout."""
    messages = _continued_exactly(results, case)
    assert "data-parallel strategy" not in messages[0]  # no strategy state to lose here


def _continued_exactly(results: list[dict[str, Any]], case: str) -> list[str]:
    """Every rank's losses after the move and every weight within 1e-12 of the run that never moved, and one warning
    (the RNG streams reset); the warnings."""
    straight: dict[str, torch.Tensor] = {}
    moved: dict[str, torch.Tensor] = {}
    for res in results:
        got = res[case]
        assert max(abs(a - b) / abs(b) for a, b in zip(got["moved"], got["straight"], strict=True)) <= 1e-12, got
        straight.update(got["straight_weights"])
        moved.update(got["moved_weights"])
    assert set(moved) == set(straight) == {f"layer{i}.0.{w}" for i in range(8) for w in ("weight", "bias")}
    for name, want in straight.items():
        assert ((moved[name] - want).norm() / want.norm()).item() <= 1e-12, name
    messages = [m for res in results for m in res[case]["warnings"]]
    assert len(messages) == 1 and "reset the random-number generators of every rank" in messages[0], messages
    return messages


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(ZERO3_MOVES))
def test_zero3_checkpoints_move_to_other_stages_and_layouts_exactly(zero3_results: list[dict[str, Any]],
                                                                    case: str) -> None:
    """Saved at ZeRO-3 (PP=2 x DP=2) and resumed at ZeRO-1 or ZeRO-0 on another layout, and back: float64 losses and
    every weight within 1e-12 of the run that never moved, one warning (the RNG streams)."""
    for res in zero3_results:
        assert len(res[case]["moved"]) == MOVED - MOVE_AT
        assert res[case]["strategies"] == ZERO3_STRATEGIES[case]
    _continued_exactly(zero3_results, case)


@pytest.mark.timeout(600)
def test_layout_bound_strategy_state_is_reset_with_one_warning(results: list[dict[str, Any]]) -> None:
    messages = [m for res in results for m in res["int8-zbh1"]["warnings"]]
    assert len(messages) == 1, messages
    assert "error-feedback residuals" in messages[0] and "compressed" in messages[0], messages[0]
    assert all(len(res["int8-zbh1"]["moved"]) == MOVED - MOVE_AT for res in results)


@pytest.mark.timeout(600)
def test_checkpoints_hold_model_names_and_plain_values(results: list[dict[str, Any]]) -> None:
    flat = read_checkpoint(str(Path(results[0]["root"]) / "int8"))
    assert "model.layer0.0.weight" in flat and "optim.state.layer7.0.bias.exp_avg" in flat
    assert not any(".stage" in k or k.startswith("model.part") for k in flat)
    dp = {k: v for k, v in flat.items() if k.startswith("dp.")}
    assert dp and all(isinstance(v, (torch.Tensor, str)) for v in dp.values())  # residuals: tensors + JSON
    assert flat["trainer.calls"] == MOVE_AT and flat["trainer.format"] == 2


@pytest.mark.timeout(600)
def test_format1_checkpoints_are_refused_saying_how_to_convert(results: list[dict[str, Any]]) -> None:
    for res in results:
        got = res["format1"]
        for message in (got["same"], got["other"]):
            assert "stage-keyed format 1" in message and "load it with duplexpipe 0.1" in message
            assert "save it again with pipe.save()" in message
            assert "\n" not in message
        assert got["calls"] == 0, "nothing was loaded"


@pytest.mark.timeout(600)
def test_bad_checkpoints_are_named_on_every_rank(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert "the checkpoint has an LR scheduler but this Pipeline has none" in res["no_scheduler"]
        message = res["other_model"]
        assert "does not match this model: 0 names missing (none), 4 unexpected (model.layer6.0.bias" in message
        assert "is not a checkpoint (no .metadata file)" in res["not_a_checkpoint"]


@pytest.mark.timeout(600)
def test_lr_schedule_resumes_mid_decay(results: list[dict[str, Any]]) -> None:
    lrs = results[0]["scheduler"]["lrs"]  # after steps SAVE_AT.. of warm-up 3 + cosine: decaying to 0.1 x lr
    assert lrs == sorted(lrs, reverse=True) and lrs[0] < 1e-2 and lrs[-1] == pytest.approx(1e-3)
