"""MoE with expert parallelism on CUDA with NCCL (PP=2 x DP=2, ep=2, 4 ranks; skipped without GPUs): equal to
one process holding every expert, with the F&B overlap on and off."""

from __future__ import annotations

from typing import Any

import pytest
from _moe_cases import MoESpec, Reference, adamw, batch, build, compare, loss_fn
from models import nccl_ranks_fit, run_workers

from duplexpipe import Pipeline, PipelineConfig, make_mesh

SPAWN_TIMEOUT_S = 300
CASES = (("dualpipev", True), ("dualpipev", False), ("1f1b", True))


def _cuda_worker(rank: int, world: int) -> dict[str, Any]:
    spec = MoESpec(aux=0.01, speed=0.01)
    out = {}
    for schedule, overlap in CASES:
        embedding, blocks, head = build(spec)
        config = PipelineConfig(schedule=schedule, num_microbatches=4, fb_overlap=overlap)
        pipe = Pipeline.from_layers(blocks, loss_fn, adamw, config, embedding=embedding, head=head,
                                    mesh=make_mesh(2, 2, "cuda", ep=2))
        losses = [pipe.step(*batch(step, pipe.groups.dp_rank)) for step in range(2)]
        ref = Reference(spec)
        want = [ref.step(step, 2, 4) for step in range(2)]
        groups = {s: pipe.schedule.stages[s].group for s in pipe.stage_modules}
        out[f"{schedule} {overlap}"] = {
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)),
            "param_err": compare(pipe.stage_modules, groups, ref.parts(pipe.partition)),
            "overlap": pipe.runtime.config.fb_overlap, "device": str(next(iter(pipe.stage_modules.values()))
                                                                    .parameters().__next__().device)}
    return out


@pytest.mark.cuda
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
def test_moe_pipeline_on_nccl_equals_one_process() -> None:
    if not nccl_ranks_fit(4):
        pytest.skip("needs 4 CUDA GPUs (or one with DUPLEXPIPE_SHARE_GPU=1)")
    results = run_workers(_cuda_worker, 4, backend="nccl", timeout_s=SPAWN_TIMEOUT_S - 30)
    for rank, result in enumerate(results):
        for name, case in result.items():
            assert case["loss_err"] < 1e-10 and case["param_err"] < 1e-10, (rank, name, case)
            assert case["device"].startswith("cuda")
        assert result["dualpipev True"]["overlap"] and not result["dualpipev False"]["overlap"]
