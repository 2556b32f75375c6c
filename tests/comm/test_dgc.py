"""Tests for duplexpipe.comm.dgc against a direct transcription of Lin et al. (2018), Algorithm 1 + Sec. 3."""

from __future__ import annotations

import math

import pytest
import torch

from duplexpipe.comm.dgc import DGCMemory, dgc_density, local_clip_threshold
from duplexpipe.comm.sparsify import keep_count, top_k


def test_warmup_sparsity_follows_the_paper_then_the_target() -> None:
    got = [dgc_density(step, 0.01, 3) for step in range(0, 15, 3)]
    assert got == [0.25, 0.0625, 0.015625, 0.01, 0.01]  # 75%, 93.75%, 98.4375%, then 99%
    deep = [1 - dgc_density(step, 0.001, 2) for step in range(0, 12, 2)]
    assert deep == pytest.approx([0.75, 0.9375, 0.984375, 0.996, 0.999, 0.999])
    assert dgc_density(0, 0.01, 0) == 0.01  # no warm-up
    assert dgc_density(1, 0.5, 1) == 0.5  # every warm-up stage is sparser than the target: skipped


def _reference(grads: list[torch.Tensor], k: int, momentum: float, clip: float | None,
               world: int) -> list[torch.Tensor]:
    """Dense masks, written from the paper in its units: node k adds G^k = g / N (Algorithm 1: grad / (N b)),
    clipped to N^(-1/2) of the global threshold (Appendix C); u = m u + G^k; v = v + u; send top-k of v
    (the sum over nodes is the update); mask u and v. Returned times N: the rank's share of the mean."""
    u = torch.zeros_like(grads[0])
    v = torch.zeros_like(grads[0])
    sent = []
    for g in grads:
        share = g / world
        if clip is not None and share.norm() > clip / math.sqrt(world):
            share = share * (clip / math.sqrt(world) / share.norm())
        u = momentum * u + share
        v = v + u
        thr = v.abs().topk(k).values.min()
        mask = v.abs() >= thr
        sent.append(torch.where(mask, v, torch.zeros_like(v)) * world)
        v = torch.where(mask, torch.zeros_like(v), v)
        u = torch.where(mask, torch.zeros_like(u), u)
    return sent


@pytest.mark.parametrize("clip_norm", [None, 2.0, 30.0])
def test_memory_matches_the_paper(clip_norm: float | None) -> None:
    world = 4
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(200, generator=gen, dtype=torch.float64) * (1 + s) for s in range(12)]  # norms 14-170
    k = keep_count(200, 0.05)
    mem = DGCMemory(0.9, clip_norm, world)
    got = []
    for g in grads:
        acc = mem.compensate(7, g, torch.float64)
        sel = top_k(acc, k)
        got.append(torch.zeros_like(acc).index_add_(0, sel.indices, sel.values))
        mem.keep_rest(7, acc, sel.chosen)
        mem.commit()
    want = _reference(grads, k, 0.9, clip_norm, world)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert sum(int((s != 0).sum()) for s in got) == 12 * k
    if clip_norm is not None:  # the mean gradient is clipped to clip_norm * sqrt(N)
        assert local_clip_threshold(clip_norm, world) == pytest.approx(clip_norm * 2)
        clipped = sum(float(g.norm()) > clip_norm * 2 for g in grads)
        assert 0 < clipped < len(grads) if clip_norm == 30.0 else clipped == len(grads)


def test_rollback_and_state_dict() -> None:
    mem = DGCMemory(0.5, None, 2)
    acc = mem.compensate(0, torch.tensor([1.0, -3.0, 2.0]), torch.float32)
    mem.keep_rest(0, acc, torch.tensor([1]))
    mem.commit()
    state = mem.state_dict()
    assert torch.equal(state["v"][0], torch.tensor([1.0, 0.0, 2.0]))
    assert torch.equal(state["u"][0], torch.tensor([1.0, 0.0, 2.0]))  # momentum factor masking
    acc = mem.compensate(0, torch.ones(3), torch.float32)
    assert torch.equal(acc, torch.tensor([2.5, 1.0, 4.0]))  # v + (0.5 u + g)
    mem.rollback()
    other = DGCMemory(0.5, None, 2)
    other.load_state_dict(state)
    assert torch.equal(other.compensate(0, torch.ones(3), torch.float32), mem.compensate(0, torch.ones(3),
                                                                                         torch.float32))
    with pytest.raises(RuntimeError, match="bucket 5 was not compensated"):
        mem.keep_rest(5, torch.zeros(3), torch.tensor([0]))
