"""Tests for duplexpipe.pipeline.stages: stage modules per rank, checkpoint wrapper, copy fingerprints."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from duplexpipe.pipeline.split import split_model
from duplexpipe.pipeline.stages import (
    CheckpointedStage,
    build_stage_modules,
    find_mismatched_copies,
    fingerprint,
    inner_module,
    resolve_checkpointing,
)
from duplexpipe.schedules.registry import build, names


def _parts(n: int, seed: int = 0) -> list[nn.Sequential]:
    torch.manual_seed(seed)
    return split_model([nn.Linear(5, 5) for _ in range(n)], n)[0]


@pytest.mark.parametrize("name", names())
def test_every_schedule_gets_one_module_per_local_stage(name: str) -> None:
    schedule = build(name, 4, 8)
    parts = _parts(schedule.num_groups)
    seen = []
    for rank in range(4):
        modules = build_stage_modules(schedule, rank, parts)
        assert sorted(modules) == list(schedule.stages_of_rank(rank))
        for stage, module in modules.items():
            assert module is not parts[schedule.stages[stage].group]
            assert fingerprint(module) == fingerprint(parts[schedule.stages[stage].group])
            seen.append(stage)
    assert sorted(seen) == list(range(schedule.num_stages))


def test_dualpipe_rank_holds_two_parts_and_mirrors_match() -> None:
    schedule = build("dualpipe", 4, 8)
    parts = _parts(4)
    r1 = build_stage_modules(schedule, 1, parts)  # stages 1 (part 1) and 6 (part 2)
    r2 = build_stage_modules(schedule, 2, parts)  # stages 2 (part 2) and 5 (part 1)
    assert sorted(r1) == [1, 6] and sorted(r2) == [2, 5]
    prints = [{s: fingerprint(m) for s, m in r.items()} for r in (r1, r2)]
    assert find_mismatched_copies(schedule, prints) == []
    with torch.no_grad():
        next(r2[5].parameters()).add_(1.0)
    prints = [{s: fingerprint(m) for s, m in r.items()} for r in (r1, r2)]
    bad = find_mismatched_copies(schedule, prints)
    assert [g for g, _ in bad] == [1] and {s for s, _ in bad[0][1]} == {1, 5}


def test_fingerprint_differs_for_different_seeds() -> None:
    assert fingerprint(_parts(1, seed=0)[0]) != fingerprint(_parts(1, seed=1)[0])


def test_checkpointed_stage_matches_plain_forward_and_grads() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    wrapped = CheckpointedStage(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)))
    wrapped.module.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    plain(x).square().sum().backward()
    wrapped(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    for a, b in zip(plain.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    assert inner_module(wrapped) is wrapped.module


def test_resolve_checkpointing_and_wrapping() -> None:
    schedule = build("1f1b", 2, 4)
    assert resolve_checkpointing(True, schedule) == {0, 1}
    assert resolve_checkpointing(False, schedule) == frozenset()
    assert resolve_checkpointing([1], schedule) == {1}
    with pytest.raises(ValueError, match=r"stages \[5\].*stages 0..1"):
        resolve_checkpointing([5], schedule)
    modules = build_stage_modules(schedule, 1, _parts(2), checkpoint_stages={1})
    assert isinstance(modules[1], CheckpointedStage)


def test_build_stage_modules_errors() -> None:
    schedule = build("1f1b", 2, 4)
    with pytest.raises(ValueError, match="needs 2 model parts, got 3"):
        build_stage_modules(schedule, 0, _parts(3))
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        build_stage_modules(schedule, 2, _parts(2))
