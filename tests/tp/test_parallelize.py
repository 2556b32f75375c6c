"""Tests for duplexpipe.tp.parallelize: PP=2 x TP=2 (4 gloo ranks, one spawn), a GPT of attention + MLP blocks in
float64 with the bundled plan, 3 AdamW steps with clipping against one process: every schedule with and without
sequence parallelism, activation checkpointing, tied weights, fp16's shared overflow decision, low-precision sends,
gradient compression on local shards (PP=1 x DP=2 x TP=2), evaluate, the "tp" lane, per-rank parameter bytes,
checkpoints resharded to PP=4 x TP=1 and PP=1 x DP=2 x TP=2 (their manifest listing every rank's shard; a flipped
shard refused on every rank), NaN in one TP rank's gradient shard (raise and skip), and bad input refused on every
rank before anything blocks."""

from __future__ import annotations

import math
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _checkpoint_faults import flip
from _tp_cases import CLIP, STEPS, Reference, adamw, batch, gpt, loss_fn, max_rel, pipeline, train
from models import shared_folder
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from duplexpipe import Pipeline, PipelineConfig, make_mesh
from duplexpipe.comm.local_tensors import local_of
from duplexpipe.errors import CheckpointError, NonFiniteGradientError
from duplexpipe.launch.tasks.gpt import gpt_tp_plan
from duplexpipe.parallel.mesh import ParallelGroups
from duplexpipe.tp.lane import TP_LANE
from duplexpipe.train.checkpoint.manifest import read_manifest
from duplexpipe.train.pipeline_config import DataParallelConfig, ObserveConfig, PrecisionConfig, SafetyConfig
from duplexpipe.train.precision import LossScaleConfig

WORLD = 4
SPAWN_TIMEOUT_S = 420
SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipe", "dualpipev")
"""The schedules run with and without sequence parallelism."""
MORE: dict[str, dict[str, Any]] = {
    "gpipe": {"schedule": "gpipe"},
    "interleaved sp": {"schedule": "interleaved-1f1b", "schedule_options": {"chunks": 2}, "sequence_parallel": True},
    "zb-h2": {"schedule": "zb-h2"},
    "checkpointing zb-h1 sp": {"schedule": "zb-h1", "activation_checkpointing": True, "sequence_parallel": True},
    "auto sp": {"schedule": "auto", "sequence_parallel": True,
                "schedule_options": {"schedules": ("1f1b",), "calibrate": False, "repeats": 1, "warmup": 0}},
    "auto calibrated": {"schedule": "auto", "schedule_options": {
        "schedules": ("1f1b",), "microbatches": (4,), "calibration_budget_s": 0.2, "calibration_cache": None,
        "repeats": 1, "warmup": 0}},
}
"""Further configurations (exact too)."""


def _tied_plan(sp: bool) -> dict[str, Any]:
    """The GPT plan with a vocabulary-parallel embedding and a column-parallel head sharing its weight."""
    rest = Shard(1) if sp else Replicate()
    return {**gpt_tp_plan(sp), "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=rest),
            "head": ColwiseParallel(input_layouts=rest, output_layouts=Replicate())}


def _exact(out: dict[str, Any]) -> None:
    """Every schedule with and without SP, and MORE: the losses of STEPS steps (and, for 1F1B, what it sent, its
    parameter bytes, its "tp" lane and an evaluation)."""
    for schedule in SCHEDULES:
        for sp in (False, True):
            pipe = pipeline((2, 1, 2), PipelineConfig(schedule, 4, sequence_parallel=sp, grad_clip_norm=CLIP,
                                                      observe=ObserveConfig(record_tp_lane=schedule == "1f1b")))
            out[f"{schedule} sp={sp}"] = train(pipe, range(STEPS))
            if schedule == "zb-h1":
                assert pipe.last is not None and pipe.last.timeline is not None
                out[f"no lane sp={sp}"] = [s for s in pipe.last.timeline.spans if s.lane == TP_LANE]
            if schedule == "1f1b":
                meter = pipe.p2p_meter
                out[f"send bytes sp={sp}"] = meter.bytes["send"] / meter.calls["send"]
                out[f"param bytes sp={sp}"] = pipe.param_bytes
                assert pipe.last is not None and pipe.last.timeline is not None
                out[f"lane sp={sp}"] = [(s.name, s.start, s.end) for s in pipe.last.timeline.spans if s.lane == TP_LANE]
                result = pipe.evaluate(*batch(STEPS))
                out[f"eval sp={sp}"] = (result.loss, None if result.outputs is None else result.outputs.tolist())
    for name, options in MORE.items():
        sample = dict(zip(("sample_input", "sample_targets"), batch(0), strict=True)) if "auto" in name else {}
        embedding, blocks, head = gpt()
        pipe = Pipeline.from_layers(blocks, loss_fn, adamw, PipelineConfig(num_microbatches=None if
                                    "auto" in name else 4, grad_clip_norm=CLIP, **options), embedding=embedding,
                                    head=head, mesh=make_mesh(2, tp=2), tp_plan=gpt_tp_plan(options.get(
                                        "sequence_parallel", False)), **sample)
        out[name] = train(pipe, range(STEPS))
        out[f"{name} sharded"] = any(isinstance(p, DTensor) for m in pipe.stage_modules.values()
                                     for p in m.parameters())
        if pipe.auto is not None:  # planned with the TP-divided costs of this mesh: its parameter bytes per rank
            best = pipe.auto.result.best
            out[f"{name} mesh"] = (best.ranks, best.dp, best.tp, pipe.auto.profile.tp_degrees)
            out[f"{name} param bytes"] = (best.memory[pipe.groups.pp_rank].params, pipe.param_bytes)
            out[f"{name} source"] = pipe.auto.source
    for name, schedule, sp in (("tied 1f1b", "1f1b", False), ("tied dualpipev sp", "dualpipev", True)):
        pipe = pipeline((2, 1, 2), PipelineConfig(schedule, 4, sequence_parallel=sp, grad_clip_norm=CLIP), tied=True,
                        plan=_tied_plan(sp))
        out[name] = train(pipe, range(STEPS))


def _precision(out: dict[str, Any]) -> None:
    """fp16 with an inf injected into one TP rank's gradient shard at step 1 (every rank must skip it), and bf16
    stage sends under SP (every rank reports the same loss)."""
    pipe = pipeline((2, 1, 2), PipelineConfig("1f1b", 4, grad_clip_norm=CLIP, precision=PrecisionConfig(dtype="fp16",
                                                                                                        loss_scale=LossScaleConfig(init_scale=2.0**10))))
    state = {"step": -1}
    if dist.get_rank() == 1:  # pipeline rank 0, TP rank 1: one shard of one weight
        weight = pipe.stage_modules[0].get_submodule("layer0.attn.q").weight
        weight.register_hook(lambda g: torch.full_like(g, math.inf) if state["step"] == 1 else g)
    skipped = []
    for step in range(STEPS):
        state["step"] = step
        pipe.step(*batch(step))
        assert pipe.last is not None
        skipped.append(pipe.last.skipped)
    out["fp16 skipped"] = skipped
    pipe = pipeline((2, 1, 2), PipelineConfig("1f1b", 4, sequence_parallel=True,
                                              precision=PrecisionConfig(p2p_compression="bf16")))
    out["bf16 sends"] = train(pipe, range(STEPS))
    pipe = pipeline((1, 2, 2), PipelineConfig("1f1b", 4, sequence_parallel=True,
                                              data_parallel=DataParallelConfig(grad_compression="bf16")))
    out["bf16 compression"] = train(pipe, range(STEPS))


def _checkpoints(out: dict[str, Any]) -> None:
    """Two steps at PP=2 x TP=2 with SP, saved; the third step at PP=4 x TP=1 and at PP=1 x DP=2 x TP=2."""
    with shared_folder("tp-ckpt-") as where:
        pipe = pipeline((2, 1, 2), PipelineConfig("1f1b", 4, sequence_parallel=True, grad_clip_norm=CLIP))
        out["saved"] = train(pipe, range(2))
        pipe.save(where)
        for name, shape in (("pp4", (4, 1, 1)), ("dp2 tp2", (1, 2, 2))):
            config = PipelineConfig("1f1b", 4, sequence_parallel=shape[2] > 1, grad_clip_norm=CLIP)
            pipe = pipeline(shape, config)
            with warnings.catch_warnings():  # rank 0 warns that the layout changed
                warnings.simplefilter("ignore", UserWarning)
                pipe.load(where)
            out[f"resumed {name}"] = train(pipe, range(2, STEPS))
        _damaged(out, where, pipe)


def _damaged(out: dict[str, Any], saved: str, pipe: Pipeline) -> None:
    """The TP checkpoint's manifest lists every rank's shard file; a copy with one TP rank's shard flipped is refused
    on every rank before anything is read."""
    if dist.get_rank() == 0:
        out["manifest"] = sorted(read_manifest(saved) or {})
        shutil.copytree(saved, f"{saved}-flipped")
        flip(Path(f"{saved}-flipped") / "__3_0.distcp")
    dist.barrier()
    try:
        pipe.load(f"{saved}-flipped")
        out["flipped"] = ""
    except CheckpointError as exc:
        out["flipped"] = str(exc)


def _nonfinite(out: dict[str, Any]) -> None:
    """NaN in one TP rank's shard of one weight at step 1 (fp64, no fp16 scaler): "raise" stops every rank naming
    the stage and parameter before any shard steps; "skip" skips the step everywhere with a non-finite norm."""
    for policy in ("raise", "skip"):
        pipe = pipeline((2, 1, 2), PipelineConfig("1f1b", 4, grad_clip_norm=CLIP,
                                                  safety=SafetyConfig(nonfinite_grads=policy)))
        state = {"step": -1}
        if dist.get_rank() == 1:  # pipeline rank 0, TP rank 1: one shard of one weight
            weight = pipe.stage_modules[0].get_submodule("layer0.attn.q").weight
            weight.register_hook(lambda g, state=state: torch.full_like(g, math.nan) if state["step"] == 1 else g)
        steps = []
        for step in range(STEPS):
            state["step"] = step
            before = [local_of(p).detach().clone() for p in pipe.params]
            try:
                pipe.step(*batch(step))
            except NonFiniteGradientError as exc:
                out["nonfinite raise"] = str(exc)
                out["nonfinite kept"] = all(torch.equal(a, local_of(p)) for a, p in zip(before, pipe.params,
                                                                                        strict=True))
                break
            assert pipe.last is not None and pipe.last.grad_norm is not None
            steps.append((pipe.last.skipped, math.isfinite(pipe.last.grad_norm)))
        out[f"nonfinite {policy} steps"] = steps


def _bad_input(out: dict[str, Any]) -> None:
    """Each bad input must raise ValueError on every rank before any rank blocks (else the spawn times out)."""
    embedding, blocks, head = gpt()
    cases: dict[str, Any] = {
        "mesh": lambda: make_mesh(3, tp=2),
        "no plan": lambda: Pipeline.from_layers(blocks, loss_fn, adamw, PipelineConfig("1f1b", 4),
                                                embedding=embedding, head=head, mesh=make_mesh(2, tp=2)),
        "missing": lambda: pipeline((2, 1, 2), PipelineConfig("1f1b", 4), plan={
            **gpt_tp_plan(), "layer*.attn.nope": ColwiseParallel()}),
        "heads": lambda: _built(gpt(n_head=1, d_model=16), gpt_tp_plan()),
        "dim": lambda: _built(gpt(vocab_size=15), {**gpt_tp_plan(), "head.out": ColwiseParallel()}),
        "tied": lambda: pipeline((2, 1, 2), PipelineConfig("1f1b", 4), tied=True, plan={
            **gpt_tp_plan(), "head": ColwiseParallel(output_layouts=Replicate())}),
    }
    for name, make in cases.items():
        try:
            make()
            out[f"error {name}"] = None
        except ValueError as exc:
            out[f"error {name}"] = str(exc)


def _built(model: tuple[Any, Any, Any], plan: Any) -> Pipeline:
    embedding, blocks, head = model
    return Pipeline.from_layers(blocks, loss_fn, adamw, PipelineConfig("1f1b", 4), embedding=embedding,
                                head=head, mesh=make_mesh(2, tp=2), tp_plan=plan)


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    out: dict[str, Any] = {}
    _groups(out)
    _bad_input(out)
    _exact(out)
    _precision(out)
    _nonfinite(out)
    _checkpoints(out)
    return out


@pytest.fixture(scope="module")
def want() -> dict[str, Any]:
    """The one-process losses, and the reference after STEPS steps evaluated on the next batch."""
    torch.set_default_dtype(torch.float64)
    try:
        ref = Reference()
        losses = ref.train(range(STEPS))
        x, y = batch(STEPS)
        with torch.no_grad():
            logits = ref.model(x)
        tied = Reference(tied=True).train(range(STEPS))
        plain = Reference(clip=None).train(range(STEPS))
    finally:
        torch.set_default_dtype(torch.float32)
    return {"losses": losses, "logits": logits, "eval loss": loss_fn(logits, y).item(), "tied": tied, "plain": plain}


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_equals_one_process(results: list[dict[str, Any]], want: dict[str, Any], schedule: str,
                                           sp: bool) -> None:
    for res in results:
        assert max_rel(res[f"{schedule} sp={sp}"], want["losses"]) <= 1e-10


@pytest.mark.parametrize("name", list(MORE))
def test_more_schedules_checkpointing_and_auto_are_exact_and_sharded(results: list[dict[str, Any]],
                                                                     want: dict[str, Any], name: str) -> None:
    for res in results:
        assert max_rel(res[name], want["losses"]) <= 1e-10
        assert res[f"{name} sharded"]


def test_auto_plans_the_tp_mesh_with_each_ranks_share(results: list[dict[str, Any]]) -> None:
    for res in results:
        for name in ("auto sp", "auto calibrated"):
            assert res[f"{name} mesh"] == (2, 1, 2, (2, 4))  # the GPT's 4 heads: TP 2 or 4
            predicted, held = res[f"{name} param bytes"]
            assert predicted == held  # the planner's parameters per rank: shards plus the replicated ones
        assert "TP link" in res["auto calibrated source"]  # measured by the calibration (all-reduces over TP)
        assert "TP link" not in res["auto sp source"]  # no calibration: the default link


def test_tied_weights_sharded_alike_are_summed_on_their_shards(results: list[dict[str, Any]],
                                                               want: dict[str, Any]) -> None:
    for res in results:
        assert max_rel(res["tied 1f1b"], want["tied"]) <= 1e-10
        assert max_rel(res["tied dualpipev sp"], want["tied"]) <= 1e-10


def test_sequence_parallel_sends_a_tp_th_of_the_bytes(results: list[dict[str, Any]]) -> None:
    for res in results:  # measured by the p2p meter, per SEND
        assert res["send bytes sp=True"] * 2 == res["send bytes sp=False"] > 0


def test_each_rank_holds_its_shards_and_the_replicated_parameters(results: list[dict[str, Any]]) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        embedding, blocks, head = gpt()
    finally:
        torch.set_default_dtype(torch.float32)
    whole = [sum(p.numel() * 8 for m in ms for p in m.parameters()) for ms in ([embedding, *blocks[:2]],
                                                                               [*blocks[2:], head])]
    sharded = [sum(p.numel() * 8 for b in bs for n, p in b.named_parameters() if n.split(".")[0] in ("attn", "mlp")
                   and not n.startswith("attn.proj.bias") and n != "mlp.2.bias") for bs in (blocks[:2], blocks[2:])]
    for rank, res in enumerate(results):
        stage = rank // 2  # rank = pp index x tp + tp index
        assert res["param bytes sp=False"] == res["param bytes sp=True"] == whole[stage] - sharded[stage] // 2


def test_evaluate_and_the_tp_lane(results: list[dict[str, Any]], want: dict[str, Any]) -> None:
    for rank, res in enumerate(results):
        for sp in (False, True):
            loss, outputs = res[f"eval sp={sp}"]
            assert abs(loss - want["eval loss"]) / want["eval loss"] <= 1e-10
            assert (outputs is None) == (rank < 2)
            if outputs is not None:
                got = torch.tensor(outputs, dtype=torch.float64)
                assert float((got - want["logits"]).norm() / want["logits"].norm()) <= 1e-10
            assert res[f"no lane sp={sp}"] == []  # record_tp_lane is off by default
            lane = res[f"lane sp={sp}"]
            assert lane and all(0 <= start <= end for _, start, end in lane)
            assert {name for name, _, _ in lane} >= ({"all_gather_into_tensor"} if sp else {"all_reduce"})


def test_fp16_overflow_in_one_shard_skips_the_step_everywhere_and_bf16_sends_agree(
        results: list[dict[str, Any]], want: dict[str, Any]) -> None:
    for res in results:
        assert res["fp16 skipped"] == [False, True, False]
        assert res["bf16 sends"] == results[0]["bf16 sends"]
        assert max_rel(res["bf16 sends"], want["plain"]) <= 1e-2


def test_gradient_compression_runs_on_the_local_shards(results: list[dict[str, Any]], want: dict[str, Any]) -> None:
    for res in results:  # PP=1 x DP=2 x TP=2: bf16 rounds the reduced gradients (close; the same on every rank)
        assert res["bf16 compression"] == results[0]["bf16 compression"]
        assert max_rel(res["bf16 compression"], want["plain"]) <= 1e-3


def test_a_tp_checkpoint_continues_exactly_in_other_layouts(results: list[dict[str, Any]],
                                                            want: dict[str, Any]) -> None:
    for res in results:
        assert max_rel(res["saved"], want["losses"][:2]) <= 1e-10
        assert max_rel(res["resumed pp4"], want["losses"][2:]) <= 1e-10
        assert max_rel(res["resumed dp2 tp2"], want["losses"][2:]) <= 1e-10


def test_nonfinite_gradients_in_one_tp_shard_stop_or_skip_every_rank(results: list[dict[str, Any]]) -> None:
    messages = {res["nonfinite raise"] for res in results}
    assert len(messages) == 1, messages  # the same error on every rank
    message = messages.pop()
    assert re.match(r"step 2: non-finite gradients, the first in stage 0, parameter '\S*layer0\.attn\.q\.weight' "
                    r"\(rank 1\) holds nan; gradient norm nan", message), message
    for res in results:
        assert res["nonfinite kept"] and res["nonfinite raise steps"] == [(False, True)]
        assert res["nonfinite skip steps"] == [(False, True), (True, False), (False, True)]


def test_a_tp_checkpoint_has_every_ranks_shard_in_its_manifest_and_a_flipped_one_is_refused(
        results: list[dict[str, Any]]) -> None:
    assert results[0]["manifest"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    for res in results:
        assert re.match(r"checkpoint \S+-flipped is incomplete or corrupt: __3_0\.distcp differs from the checksum",
                        res["flipped"]), res["flipped"]


def test_bad_input_is_refused_on_every_rank_before_anything_blocks(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert "pp x dp x tp = 3 x 1 x 2 = 6 must equal the world size 4" in res["error mesh"]
        assert "tp=2 but no tp_plan" in res["error no plan"]
        assert "'layer*.attn.nope'" in res["error missing"] and "TP degree 2" in res["error missing"]
        assert "'layer0.attn' (CausalSelfAttention) has n_head=1, not divisible by the TP degree 2" in \
            res["error heads"]
        assert "'head.out' (Linear) has out_features=15, not divisible by the TP degree 2" in res["error dim"]
        assert "tied parameter 0 is sharded differently" in res["error tied"]


def _groups(out: dict[str, Any]) -> None:
    """Global ranks of each group of this process, for two meshes of the world."""
    for name, mesh in (("pp2 tp2", make_mesh(2, tp=2)), ("dp2 tp2", make_mesh(1, 2, tp=2))):
        groups = ParallelGroups.from_mesh(mesh)
        out[f"groups {name}"] = {k: sorted(dist.get_process_group_ranks(g)) if g is not None else None for k, g in (
            ("pp", groups.pp_group), ("dp", groups.dp_group), ("tp", groups.tp_group))}
        out[f"groups {name}"]["ranks"] = (groups.pp_rank, groups.dp_rank, groups.tp_rank, groups.tp_size)


def test_tp_is_the_innermost_dimension_and_each_dp_tp_coordinate_has_its_pipeline(
        results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        pp2 = res["groups pp2 tp2"]
        assert pp2["pp"] == [rank % 2, rank % 2 + 2] and pp2["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert pp2["dp"] == [rank] and pp2["ranks"] == (rank // 2, 0, rank % 2, 2)
        dp2 = res["groups dp2 tp2"]
        assert dp2["dp"] == [rank % 2, rank % 2 + 2] and dp2["tp"] == pp2["tp"]
        assert dp2["ranks"] == (0, rank // 2, rank % 2, 2)
