"""Compiled stages with tensor and expert parallelism on 4 gloo ranks (float64) against one eager process: an MoE
model with expert parallelism under DualPipeV, compiled (aot_eager), with the F&B overlap on and off bit-equal and equal
to one process holding every expert; PP=2 x TP=2 with DTensor parameters compiled after parallelize_module (inductor
and aot_eager), whose split regions stay split."""

from __future__ import annotations

import logging
from typing import Any

import torch
from _moe_cases import MoESpec, Reference, adamw, batch, build, compare, loss_fn, snapshot
from _tp_cases import CLIP, STEPS, max_rel, pipeline, train
from _tp_cases import Reference as TPReference
from torch.distributed.tensor import DTensor

from duplexpipe import Pipeline, PipelineConfig, make_mesh

WORLD = 4
SPAWN_TIMEOUT_S = 570
EAGER_AOT = {"backend": "aot_eager"}
MOE_STEPS, MOE_MICRO = 3, 4
TP_CASES = {"zb-h1 sp inductor": ("zb-h1", True, "inductor"), "dualpipev aot_eager": ("dualpipev", False, "aot_eager")}
"""PP=2 x TP=2 runs: schedule, sequence parallelism, backend (inductor with DTensor parameters, SP and a split
backward in one run; the other placements with aot_eager)."""


def _moe(overlap: bool) -> dict[str, Any]:
    spec = MoESpec(aux=0.01, speed=0.01)
    embedding, blocks, head = build(spec)
    config = PipelineConfig(schedule="dualpipev", num_microbatches=MOE_MICRO, fb_overlap=overlap, compile=EAGER_AOT)
    pipe = Pipeline.from_layers(blocks, loss_fn, adamw, config, embedding=embedding, head=head,
                                mesh=make_mesh(2, 2, ep=2))
    losses = [pipe.step(*batch(step, pipe.groups.dp_rank)) for step in range(MOE_STEPS)]
    ref = Reference(spec)
    want = [ref.step(step, 2, MOE_MICRO) for step in range(MOE_STEPS)]
    groups = {s: pipe.schedule.stages[s].group for s in pipe.stage_modules}
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)),
            "param_err": compare(pipe.stage_modules, groups, ref.parts(pipe.partition)),
            "state": snapshot(pipe.stage_modules), "compiled": pipe.compiled.modules,
            "overlap": pipe.runtime.config.fb_overlap}


def _tp() -> dict[str, Any]:
    """The TP_CASES: losses, whether the parameters are DTensors, and the warnings of regions left whole."""
    whole: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: whole.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("duplexpipe.compile").addHandler(handler)
    out: dict[str, Any] = {}
    try:
        for name, (schedule, sp, backend) in TP_CASES.items():
            pipe = pipeline((2, 1, 2), PipelineConfig(schedule, 4, sequence_parallel=sp, grad_clip_norm=CLIP,
                                                      compile={"backend": backend}))
            out[name] = {"losses": train(pipe, range(STEPS)), "compiled": pipe.compiled.modules,
                         "dtensors": any(isinstance(p, DTensor) for m in pipe.stage_modules.values()
                                         for p in m.parameters())}
    finally:
        logging.getLogger("duplexpipe.compile").removeHandler(handler)
    out["whole"] = [m for m in whole if "stays one graph" in m or "run their backward whole" in m]
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    on, off = _moe(True), _moe(False)
    return {"tp": _tp(),
            "moe": {"bit_equal": on["state"].keys() == off["state"].keys()
                    and all(torch.equal(on["state"][key], off["state"][key]) for key in on["state"]),
                    **{f"{key} {o}": r[key] for o, r in (("on", on), ("off", off))
                       for key in ("loss_err", "param_err", "compiled", "overlap")}}}


def test_moe_with_expert_parallelism_compiled_overlap_on_and_off_are_bit_equal(results: list[dict[str, Any]]) -> None:
    for rank in results:
        moe = rank["moe"]
        assert moe["bit_equal"], moe
        assert moe["overlap on"] and not moe["overlap off"] and moe["compiled on"] > 0, moe
        assert moe["loss_err on"] < 1e-9 and moe["param_err on"] < 1e-9, moe


def test_tensor_parallel_compiled_blocks_equal_one_eager_process_and_split_their_backward(
        results: list[dict[str, Any]]) -> None:
    want = TPReference().train(range(STEPS))
    for rank in results:
        tp = rank["tp"]
        assert not tp["whole"], tp["whole"]  # DTensor regions split into I and W graphs, none left whole
        for name in TP_CASES:
            assert tp[name]["dtensors"] and tp[name]["compiled"] > 0, (name, tp[name])
            assert max_rel(tp[name]["losses"], want) < 1e-9, (name, tp[name])
