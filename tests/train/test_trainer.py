"""Tests for duplexpipe.train.trainer: pipelined training equals single-process training.

All multi-rank cases run in one launch of 4 gloo processes (module-scoped fixture); each rank
trains the single-process reference itself and reports its differences.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _train_helpers import Reference, adam, batch, make_parts, max_param_diff, max_rel_diff, mse
from models import run_workers

from duplexpipe.launch.processes import launch
from duplexpipe.parallel import replicated
from duplexpipe.parallel.mesh import make_mesh
from duplexpipe.train.pipeline_config import PrecisionConfig, SafetyConfig
from duplexpipe.train.trainer import Pipeline, PipelineConfig

STEPS = 20
GENEROUS_TIMEOUT_S = 60.0
"""The failure tests' wait limit for everything but the waits expected to time out."""
SHORT_TIMEOUT_S = 2.0
"""The limit of the gradient reduction's waits in the dead-peer test (the one timeout it expects)."""
PEER_LIMIT_S = 30.0
"""Every rank must stop within this long after another rank failed (the requirement)."""
CLIP = 0.15


def _groups(pipe: Pipeline) -> dict[int, int]:
    return {s: pipe.schedule.stages[s].group for s in pipe.stage_modules}


def _equivalence(schedule: str, microbatches: int, clip: float | None = None, dp: int = 1,
                 checkpointing: bool = False) -> dict[str, Any]:
    pp = dist.get_world_size() // dp
    mesh = make_mesh(pp, dp) if dp > 1 else None
    cfg = PipelineConfig(schedule=schedule, num_microbatches=microbatches, grad_clip_norm=clip,
                         activation_checkpointing=checkpointing)
    parts = make_parts(8 if schedule == "dualpipev" else pp)
    pipe = Pipeline(parts, mse, adam, cfg, mesh=mesh)
    ref = Reference(parts, clip)
    losses, ref_losses, norms = [], [], []
    for step in range(STEPS):
        x, y = batch(step)
        ref_losses += ref.step([(x, y)])
        lo = pipe.groups.dp_rank * (16 // dp)
        losses.append(pipe.step(x[lo:lo + 16 // dp], y[lo:lo + 16 // dp]))
        norms.append(pipe.last.grad_norm)
    return {"loss_rel": max_rel_diff(losses, ref_losses), "param": max_param_diff(pipe.stage_modules,
            _groups(pipe), ref), "decreased": losses[-1] < losses[0], "norms": norms,
            "coords": (pipe.groups.pp_rank, pipe.groups.dp_rank, pipe.groups.pp_size, pipe.groups.dp_size)}


def _accumulation() -> dict[str, Any]:
    parts = make_parts(4)
    pipe = Pipeline(parts, mse, adam, PipelineConfig("1f1b", 4, accumulation_steps=2, grad_clip_norm=0.3))
    ref = Reference(parts, 0.3)
    losses, ref_losses, applied = [], [], []
    for step in range(6):
        window = [batch(2 * step, 16), batch(2 * step + 1, 8)]  # unequal sizes: weights 2/3 and 1/3
        ref_losses += ref.step(window)
        for x, y in window:
            losses.append(pipe.step(x, y))
            applied.append(pipe.last.applied)
    return {"loss_rel": max_rel_diff(losses, ref_losses), "applied": applied,
            "param": max_param_diff(pipe.stage_modules, _groups(pipe), ref)}


def _evaluate_and_bf16() -> dict[str, Any]:
    parts = make_parts(4)
    pipe = Pipeline(parts, mse, adam, PipelineConfig("dualpipe", 8))
    x, y = batch(0)
    result = pipe.evaluate(x, y)
    ref = torch.nn.Sequential(*parts)(x)
    out: dict[str, Any] = {"has_outputs": result.outputs is not None, "loss": result.loss,
                           "ref_loss": mse(ref, y).item()}
    if result.outputs is not None:
        out["out_diff"] = (result.outputs - ref).abs().max().item()
    bf16 = Pipeline(parts, mse, adam, PipelineConfig("1f1b", 4, precision=PrecisionConfig(dtype="bf16")))
    losses = [bf16.step(*batch(s)) for s in range(5)]
    bf_eval = bf16.evaluate(x)
    out["bf16_dtype"] = str(bf_eval.outputs.dtype) if bf_eval.outputs is not None else None
    out["bf16_finite"] = all(torch.isfinite(torch.tensor(losses)).tolist())
    out["bf16_first"] = losses[0]
    return out


def _loss_reductions() -> dict[str, Any]:
    """PP=2 x DP=2: the step's float64 scalar all-reduces (the loss): one per step, over the job."""
    pipe = Pipeline(make_parts(2), mse, adam, PipelineConfig("1f1b", 4), mesh=make_mesh(2, 2))
    real = dist.all_reduce
    seen: list[int] = []

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.dtype == torch.float64 and tensor.numel() == 1:
            seen.append(dist.get_world_size(kwargs.get("group")))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        losses = []
        for step in range(3):
            x, y = batch(step)
            losses.append(pipe.step(x[8 * pipe.groups.dp_rank:][:8], y[8 * pipe.groups.dp_rank:][:8]))
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
    return {"group_sizes": seen, "losses": losses}


def _mismatched_mirrors() -> str:
    try:
        Pipeline(make_parts(4, seed=dist.get_rank()), mse, adam, PipelineConfig("dualpipe", 8))
    except ValueError as exc:
        return str(exc)
    return ""


def _zero3_residency() -> dict[str, Any]:
    """ZeRO-3 at PP=2 x DP=2: a schedule that already holds UNSHARD / RESHARD / REDUCE_GRAD runs as it is (the same
    losses as the trainer's own lowering of it), and evaluate() leaves no parameter gathered."""
    from duplexpipe.schedules.registry import build
    from duplexpipe.schedules.shard import add_unshard_reshard
    from duplexpipe.train.pipeline_config import DataParallelConfig

    zero3 = DataParallelConfig(zero_stage=3)
    held = add_unshard_reshard(build("1f1b", 2, 4), 1)
    out: dict[str, Any] = {}
    for name, schedule in (("lowered", "1f1b"), ("held", held)):
        pipe = Pipeline(make_parts(2), mse, adam, PipelineConfig(schedule, 4, data_parallel=zero3),
                        mesh=make_mesh(2, 2))
        lo = 8 * pipe.groups.dp_rank
        out[name] = [pipe.step(x[lo:lo + 8], y[lo:lo + 8]) for x, y in map(batch, range(2))]
        x, y = batch(2)
        pipe.evaluate(x[lo:lo + 8], y[lo:lo + 8])
        out[f"{name}_gathered_after_evaluate"] = pipe.dp.unsharded_bytes()  # type: ignore[attr-defined]
    return out


def _partition_by_rank0() -> dict[str, Any]:
    """from_layers with balance="time": only rank 0 profiles, every rank gets its partition; a balance rank 0
    refuses is raised on every rank (none waits for a partition)."""
    from duplexpipe.train import trainer

    real, calls = trainer.plan_partition, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("sample_input") is not None)
        return real(*args, **kwargs)

    trainer.plan_partition = counting  # type: ignore[assignment]
    try:
        x, _ = batch(0)
        width = x.shape[1]
        blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(8)]
        pipe = Pipeline.from_layers(blocks, mse, adam, PipelineConfig("1f1b", 4), balance="time", sample_input=x)
        out: dict[str, Any] = {"balance": pipe.partition.balance if pipe.partition else None}
        try:
            Pipeline.from_layers(blocks, mse, adam, PipelineConfig("1f1b", 4), balance=[1, 1, 1, 1])
        except ValueError as exc:
            out["refused"] = str(exc)
        return {**out, "calls": calls}
    finally:
        trainer.plan_partition = real  # type: ignore[assignment]


def _all_cases() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "1f1b": _equivalence("1f1b", 4, clip=CLIP),
        "dualpipe": _equivalence("dualpipe", 8, clip=CLIP),
        "dualpipev": _equivalence("dualpipev", 8),
        "pp2xdp2": _equivalence("dualpipe", 4, clip=CLIP, dp=2),
        "checkpointed": _equivalence("dualpipe", 8, checkpointing=True),
        "accumulation": _accumulation(),
        "evaluate": _evaluate_and_bf16(),
        "mirrors": _mismatched_mirrors(),
        "loss_reductions": _loss_reductions(),
        "zero3": _zero3_residency(),
        "partition": _partition_by_rank0(),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(_all_cases, 4, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["1f1b", "dualpipe", "dualpipev", "pp2xdp2", "checkpointed"])
def test_pipelined_training_matches_single_process(results: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(results):
        got = res[case]
        assert got["loss_rel"] < 1e-5, (rank, got)
        assert got["param"] < 1e-4, (rank, got)
        assert got["decreased"]
    norms = results[0][case]["norms"]
    if case in ("dualpipev", "checkpointed"):  # no clipping, no fp16: the norm is computed all the same (every
        # step checks the gradients for NaN/inf), finite, and the same on every rank
        assert all(isinstance(n, float) and 0 < n < float("inf") for n in norms), norms
        assert all(r[case]["norms"] == norms for r in results)
    else:  # clipping was active on some steps and every rank saw the same global norm
        assert sum(n > CLIP for n in norms) >= 3 and sum(n < CLIP for n in norms) >= 1, norms
        assert all(r[case]["norms"] == norms for r in results)


@pytest.mark.timeout(300)
def test_mesh_places_rank_at_pp_times_dp_plus_dp(results: list[dict[str, Any]]) -> None:
    assert [tuple(res["pp2xdp2"]["coords"]) for res in results] == [(0, 0, 2, 2), (0, 1, 2, 2),
                                                                     (1, 0, 2, 2), (1, 1, 2, 2)]
    assert [tuple(res["1f1b"]["coords"]) for res in results] == [(r, 0, 4, 1) for r in range(4)]


@pytest.mark.timeout(300)
def test_accumulation_is_the_mean_over_the_window(results: list[dict[str, Any]]) -> None:
    for res in results:
        got = res["accumulation"]
        assert got["applied"] == [False, True] * 6
        assert got["loss_rel"] < 1e-5 and got["param"] < 1e-4, got


@pytest.mark.timeout(300)
def test_evaluate_returns_batch_order_outputs_and_bf16_autocasts(results: list[dict[str, Any]]) -> None:
    holders = [r for r, res in enumerate(results) if res["evaluate"]["has_outputs"]]
    assert holders == [0, 3]  # DualPipe's last stages: stage 3 on rank 3 and stage 7 on rank 0
    for r in holders:
        assert results[r]["evaluate"]["out_diff"] < 1e-6
    for res in results:
        ev = res["evaluate"]
        assert abs(ev["loss"] - ev["ref_loss"]) < 1e-6 * ev["ref_loss"]
        assert ev["bf16_finite"]
        assert abs(ev["bf16_first"] - ev["ref_loss"]) < 0.05 * ev["ref_loss"]
    assert results[3]["evaluate"]["bf16_dtype"] == "torch.bfloat16"


@pytest.mark.timeout(300)
def test_mismatched_mirror_copies_are_rejected_on_every_rank(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert "copies of a model part start with different weights" in res["mirrors"]
        assert "stage 0=" in res["mirrors"] and "stage 4=" in res["mirrors"]


@pytest.mark.timeout(300)
def test_the_loss_is_reduced_once_per_step_over_the_whole_job(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["loss_reductions"]["group_sizes"] == [4, 4, 4]  # one per step, all 4 ranks
    assert len({tuple(res["loss_reductions"]["losses"]) for res in results}) == 1


def _stall_until_flagged(pipe: Pipeline) -> Any:
    def stall(*args: Any, **kwargs: Any) -> None:
        dog = pipe.runtime.watchdog
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not dog.store.check([dog.key]):
            time.sleep(0.05)
        raise RuntimeError("stalled rank released")
    return stall


def _shorten_timeout_first(pipe: Pipeline, method: Any) -> Any:
    """`method`, which first sets the job's wait limit to SHORT_TIMEOUT_S: only the waits of the
    gradient reduction that follows run under it (everything before has GENEROUS_TIMEOUT_S, so a slow
    peer on a loaded machine cannot make an earlier wait time out instead)."""
    def shortened(*args: Any, **kwargs: Any) -> Any:
        pipe.runtime.watchdog.timeout_s = SHORT_TIMEOUT_S
        return method(*args, **kwargs)
    return shortened


def _collective_failure(rank: int, world: int, kind: str) -> dict[str, Any]:
    """PP=2 x DP=2 with clipping; on the second step rank 3 either never joins the data-parallel
    all-reduce (a dead peer) or fails when posting it (a failed peer)."""
    cfg = PipelineConfig("1f1b", 4, grad_clip_norm=1.0, safety=SafetyConfig(timeout_s=GENEROUS_TIMEOUT_S))
    pipe = Pipeline(make_parts(2), mse, adam, cfg, mesh=make_mesh(2, 2))
    x, y = batch(0)
    pipe.step(x[:8], y[:8])
    if rank == 3:
        def boom(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("boom in the gradient all-reduce")
        if kind == "dead":  # never joins the data-parallel all-reduce, never comes back from waiting for it
            replicated.post_all_reduce = lambda *args: None  # type: ignore[assignment]
            pipe.dp.finish = _stall_until_flagged(pipe)  # type: ignore[method-assign]
        else:
            replicated.post_all_reduce = boom  # type: ignore[assignment]
    elif kind == "dead":
        pipe.dp.finish = _shorten_timeout_first(pipe, pipe.dp.finish)  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        pipe.step(x[:8], y[:8])
        out: dict[str, Any] = {"type": "ran"}
    except Exception as exc:  # noqa: BLE001 - inspected by the tests
        out = {"type": type(exc).__name__, "text": str(exc), "failed_rank": getattr(exc, "failed_rank", None)}
    out["seconds"] = time.monotonic() - start
    return out


@pytest.fixture(scope="module")
def failures() -> dict[str, list[dict[str, Any]]]:
    return {kind: run_workers(_collective_failure, 4, (kind,), timeout_s=120) for kind in ("dead", "failed")}


@pytest.mark.timeout(300)
def test_only_rank_0_profiles_the_partition_and_its_refusal_reaches_every_rank(results: list[dict[str, Any]]) -> None:
    got = [r["partition"] for r in results]
    assert got[0]["calls"] == [True, False], got[0]  # profiled with the sample, then the refused balance
    assert all(g["calls"] == [] for g in got[1:]), got
    assert all(g["balance"] == got[0]["balance"] and sum(got[0]["balance"]) == 8 for g in got), got
    for g in got:
        assert g.get("refused", "").startswith("balance [1, 1, 1, 1] sums to 4, but the model has 8 layers"), g


@pytest.mark.timeout(300)
def test_a_failed_peer_in_a_trainer_collective_is_named_on_every_rank(failures: Any) -> None:
    got = failures["failed"]
    assert got[3]["type"] == "RuntimeError" and "boom in the gradient all-reduce" in got[3]["text"], got[3]
    for rank in (0, 1, 2):
        assert got[rank]["type"] == "PeerFailedError" and got[rank]["failed_rank"] == 3, (rank, got[rank])
        assert "stopping because global rank 3 failed: RuntimeError: boom" in got[rank]["text"], got[rank]
        # told by the flag, not by a timeout (none can fire before GENEROUS_TIMEOUT_S)
        assert got[rank]["seconds"] < PEER_LIMIT_S, (rank, got[rank])


@pytest.mark.timeout(300)
def test_a_dead_peer_in_a_trainer_collective_times_out_naming_the_collective(failures: Any) -> None:
    """Rank 3 never joins the data-parallel all-reduce: rank 2 waits for it there, ranks 0 and 1 in
    the global-norm all-reduce (or their own data-parallel one, if a peer is slow). Every waiting rank
    stops: by its own timeout naming the collective, or told by a rank that timed out."""
    got = failures["dead"]
    timed_out = [r for r in (0, 1, 2) if got[r]["type"] == "PipelineTimeoutError"]
    assert timed_out, got
    for rank in (0, 1, 2):
        assert got[rank]["seconds"] < GENEROUS_TIMEOUT_S, (rank, got[rank])  # not a wait of the pipeline
        if rank in timed_out:
            assert f"timed out after {SHORT_TIMEOUT_S:g} s waiting for the" in got[rank]["text"], (rank, got[rank])
            assert "all-reduce" in got[rank]["text"], (rank, got[rank])
        else:
            assert got[rank]["type"] == "PeerFailedError" and got[rank]["failed_rank"] in timed_out, got[rank]
    if 2 in timed_out:
        assert "the data-parallel gradient all-reduce" in got[2]["text"], got[2]


@pytest.mark.timeout(300)
def test_zero3_runs_a_schedule_with_its_own_residency_and_evaluate_reshards(results: list[dict[str, Any]]) -> None:
    for res in results:
        got = res["zero3"]
        assert got["held"] == got["lowered"] and len(got["held"]) == 2, got
        assert got["lowered_gathered_after_evaluate"] == got["held_gathered_after_evaluate"] == 0, got


def test_residency_actions_without_zero3_are_refused_at_construction() -> None:
    """A schedule (e.g. a file) holding UNSHARD / RESHARD / REDUCE_GRAD without zero_stage=3: one ValueError naming
    them, before any process group is needed."""
    from duplexpipe.schedules.registry import build
    from duplexpipe.schedules.shard import add_unshard_reshard

    held = add_unshard_reshard(build("1f1b", 1, 4), 1)
    with pytest.raises(ValueError, match=r"schedule '1f1b' holds ZeRO-3's REDUCE_GRAD/RESHARD/UNSHARD actions, which "
                                         r"run only with zero_stage=3 and a data-parallel group \(this pipeline: "
                                         r"zero_stage=0, dp=1\)"):
        Pipeline(make_parts(1), mse, adam, PipelineConfig(held, 4))


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="accumulation_steps must be an int >= 1, got 0"):
        PipelineConfig(accumulation_steps=0)
    with pytest.raises(ValueError, match=r"grad_clip_norm must be a finite number > 0 or None \(no clipping\), got -1"):
        PipelineConfig(grad_clip_norm=-1)
    with pytest.raises(ValueError, match="unknown precision 'fp64'"):
        PipelineConfig(precision=PrecisionConfig(dtype="fp64"))
    with pytest.raises(ValueError, match=r"PipelineConfig.schedule must be a Schedule, a schedule file \(.json, .csv\) "
                                         "or one of gpipe, 1f1b, .*; got 'nonexistent'"):
        PipelineConfig(schedule="nonexistent")
