"""Tests for duplexpipe.model.stages: stage modules per rank (only this rank's parts built), activation checkpointing
(whole stages, selective, every k-th block), copy fingerprints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from duplexpipe.launch.processes import launch
from duplexpipe.model.split import split_model
from duplexpipe.model.stages import (
    CheckpointedStage,
    Checkpointing,
    block_index,
    build_stage_modules,
    checkpoint_block,
    find_mismatched_copies,
    fingerprint,
    inner_module,
    on_meta,
    part_blocks,
    reset_parameters,
    resolve_checkpointing,
    seeded_init,
    seeded_part,
    selective_context,
)
from duplexpipe.schedules.registry import build, names
from duplexpipe.train.trainer import Pipeline, PipelineConfig


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
    assert set(resolve_checkpointing(True, schedule)) == {0, 1}
    assert set(resolve_checkpointing(False, schedule)) == set()
    assert set(resolve_checkpointing([1], schedule)) == {1}
    with pytest.raises(ValueError, match=r"stages \[5\].*stages 0..1"):
        resolve_checkpointing([5], schedule)
    modules = build_stage_modules(schedule, 1, _parts(2), checkpoint_stages={1})
    assert isinstance(modules[1], CheckpointedStage)


def test_checkpointing_values() -> None:
    schedule = build("1f1b", 2, 4)
    assert resolve_checkpointing("full", schedule) == Checkpointing(frozenset({0, 1}))
    assert resolve_checkpointing(True, schedule) == resolve_checkpointing("full", schedule)
    assert resolve_checkpointing("selective", schedule) == Checkpointing(frozenset({0, 1}), "selective")
    assert resolve_checkpointing({"every": 2}, schedule) == Checkpointing(frozenset({0, 1}), every=2)
    assert 1 in resolve_checkpointing([1], schedule) and 0 not in resolve_checkpointing([1], schedule)
    assert resolve_checkpointing({"blocks": [1, 6]}, schedule) == Checkpointing(frozenset({0, 1}),
                                                                                blocks=frozenset({1, 6}))
    assert resolve_checkpointing({"blocks": 3}, schedule).blocks == frozenset({3})
    for bad in ("half", {"every": 0}, {"every": 2, "policy": "x"}, [0.5], {"every": True}, {"blocks": []},
                {"blocks": [-1]}, {"blocks": [1.5]}, {"blocks": "0"}, {"blocks": [0], "every": 2}):
        with pytest.raises(ValueError, match="activation_checkpointing must be"):
            PipelineConfig(activation_checkpointing=bad)
    modules = build_stage_modules(schedule, 1, _parts(2), checkpoint_stages=resolve_checkpointing("selective",
                                                                                                    schedule))
    assert isinstance(modules[1], CheckpointedStage) and modules[1].context_fn is selective_context


def test_every_k_checkpoints_blocks_in_place() -> None:
    """{"every": 2}: the blocks numbered 1, 3, 5, 7 of the whole model, each its own region, their module paths
    and state dict names unchanged; the same rule picks the blocks `compile` compiles."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(8)]
    parts = split_model(layers, 2)[0]
    schedule = build("1f1b", 2, 4)
    every = resolve_checkpointing({"every": 2}, schedule)
    modules = build_stage_modules(schedule, 1, parts, checkpoint_stages=every)
    stage = modules[1]
    assert stage.state_dict().keys() == parts[1].state_dict().keys()
    assert [type(b).__name__ for b in part_blocks(stage)] == ["Sequential", "CheckpointedSequential"] * 2
    assert [block_index(stage, b, i) for i, b in enumerate(part_blocks(stage))] == [4, 5, 6, 7]
    assert checkpoint_block(stage.layer5) is stage.layer5 and type(stage.layer5).__name__ == "CheckpointedSequential"
    x = torch.randn(3, 5, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    parts[1](x).square().sum().backward()
    stage(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    for a, b in zip(parts[1].parameters(), stage.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    plain = build_stage_modules(schedule, 0, [nn.Linear(5, 5), nn.Linear(5, 5)], checkpoint_stages=every)
    assert not isinstance(plain[0], CheckpointedStage)  # a part without blocks is block <part index>: 0 is not


def test_named_blocks_are_checkpointed_in_place() -> None:
    """{"blocks": [5, 6]}: those blocks of the whole model, wherever they sit, each its own region."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(8)]
    parts = split_model(layers, 2)[0]
    schedule = build("1f1b", 2, 4)
    named = resolve_checkpointing({"blocks": [5, 6]}, schedule)
    stage = build_stage_modules(schedule, 1, parts, checkpoint_stages=named)[1]
    assert [type(b).__name__ for b in part_blocks(stage)] == ["Sequential", "CheckpointedSequential",
                                                               "CheckpointedSequential", "Sequential"]
    first = build_stage_modules(schedule, 0, parts, checkpoint_stages=named)[0]
    assert all(type(b).__name__ == "Sequential" for b in part_blocks(first))  # blocks 0-3: none named


def test_build_stage_modules_errors() -> None:
    schedule = build("1f1b", 2, 4)
    with pytest.raises(ValueError, match="needs 2 model parts, got 3"):
        build_stage_modules(schedule, 0, _parts(3))
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        build_stage_modules(schedule, 2, _parts(2))


# --- building only this rank's parts -------------------------------------------------------------

WIDE = 96


def _wide_part(k: int) -> nn.Sequential:
    """Model part k of the memory cases: two WIDE x WIDE Linear layers (74 KiB of float32)."""
    del k
    return nn.Sequential(nn.Linear(WIDE, WIDE), nn.Tanh(), nn.Linear(WIDE, WIDE))


def _meta_parts(n: int) -> list[nn.Module]:
    with torch.device("meta"):
        return [_wide_part(k) for k in range(n)]


def _whole_reference(n: int, seed: int) -> list[nn.Module]:
    """The model built whole in one process, each part seeded per part: what ranks must reproduce."""
    parts = [_wide_part(k) for k in range(n)]
    init = seeded_init(seed)
    for k, part in enumerate(parts):
        init(part, k)
    return parts


class AllocationMeter(TorchDispatchMode):
    """Counts the bytes of every new CPU storage an aten op returns (views and in-place results
    reuse an input's storage and are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta \
                    and t.untyped_storage().data_ptr() not in given:
                self.bytes += t.untyped_storage().nbytes()
        return out


def test_factory_is_called_only_for_this_ranks_parts() -> None:
    schedule = build("dualpipe", 4, 8)
    calls: list[int] = []

    def factory(k: int) -> nn.Module:
        calls.append(k)
        with seeded_part(7, k):
            return _wide_part(k)

    modules = build_stage_modules(schedule, 1, factory)
    assert sorted(modules) == [1, 6] and sorted(calls) == [1, 2]  # rank 1 holds parts 1 and 2
    want = []
    for k in range(4):
        with seeded_part(7, k):
            want.append(_wide_part(k))
    assert fingerprint(modules[1]) == fingerprint(want[1]) and fingerprint(modules[6]) == fingerprint(want[2])
    assert fingerprint(want[1]) != fingerprint(want[2])


def test_meta_parts_are_materialised_and_initialised_only_here() -> None:
    schedule = build("1f1b", 4, 4)
    parts = _meta_parts(4)
    seen: list[int] = []
    init = seeded_init(3)

    def record(part: nn.Module, k: int) -> None:
        seen.append(k)
        init(part, k)

    with AllocationMeter() as meter:
        modules = build_stage_modules(schedule, 2, parts, init=record)
    local = sum(p.numel() * p.element_size() for p in modules[2].parameters())
    assert seen == [2] and meter.bytes == local  # exactly part 2's parameters were allocated
    assert all(on_meta(p) for p in parts)  # the given parts stay on meta
    assert fingerprint(modules[2]) == fingerprint(_whole_reference(4, 3)[2])


def test_seeded_init_and_reset_parameters() -> None:
    a, b = _wide_part(0), _wide_part(0)
    seeded_init(5)(a, 1)
    seeded_init(5)(b, 1)
    assert fingerprint(a) == fingerprint(b)
    seeded_init(5)(b, 2)
    assert fingerprint(a) != fingerprint(b)
    state = torch.random.get_rng_state()
    seeded_init(5)(a, 0)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's RNG is untouched

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)
            self.gain = nn.Parameter(torch.ones(2))

    with pytest.raises(ValueError, match="owns gain"):
        reset_parameters(Scaled())


def test_meta_parts_without_init_and_bad_factories_fail_clearly() -> None:
    schedule = build("1f1b", 2, 4)
    with pytest.raises(ValueError, match="model part 0 is on the meta device; pass init="):
        build_stage_modules(schedule, 0, _meta_parts(2))
    with pytest.raises(TypeError, match=r"part_factory\(1\) returned a int, not an nn.Module"):
        build_stage_modules(schedule, 1, lambda k: k)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match=r"part_factory\(0\) built the part on the meta device"):
        build_stage_modules(schedule, 0, lambda k: _meta_parts(1)[0])
    meta_factory = build_stage_modules(schedule, 0, lambda k: _meta_parts(1)[0], init=seeded_init(0))
    assert not on_meta(meta_factory[0])


def _construction_case(schedule: str, how: str) -> dict[str, Any]:
    world = dist.get_world_size()
    num_parts = 2 * world if schedule == "dualpipev" else world
    calls: list[int] = []
    if how == "meta":
        init = seeded_init(11)

        def record(part: nn.Module, k: int) -> None:
            calls.append(k)
            init(part, k)
        source: Any = _meta_parts(num_parts)
        kwargs: dict[str, Any] = {"init": record}
    else:
        def factory(k: int) -> nn.Module:
            calls.append(k)
            with seeded_part(11, k):
                part = _wide_part(k)
            seeded_init(11)(part, k)  # the same weights as the meta path and the reference
            return part
        source, kwargs = factory, {}
    with AllocationMeter() as meter:
        pipe = Pipeline(source, _mse, _sgd, PipelineConfig(schedule, 8), **kwargs)
    prints = {s: fingerprint(m) for s, m in pipe.stage_modules.items()}
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, WIDE, generator=gen), torch.randn(16, WIDE, generator=gen)
    losses = [pipe.step(x, y) for _ in range(2)]
    held = {s: pipe.schedule.stages[s].group for s in pipe.stage_modules}
    return {"bytes": meter.bytes, "calls": sorted(calls), "held": held, "losses": losses,
            "params": sum(p.numel() * p.element_size() for p in pipe.params),
            "prints": prints}


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _construction_cases() -> dict[str, Any]:
    return {f"{schedule}-{how}": _construction_case(schedule, how)
            for schedule in ("1f1b", "dualpipe", "dualpipev") for how in ("meta", "factory")}


@pytest.fixture(scope="module")
def construction() -> list[dict[str, Any]]:
    return launch(_construction_cases, 4, timeout_s=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule, share", [("1f1b", 1 / 4), ("dualpipe", 2 / 4), ("dualpipev", 2 / 8)])
@pytest.mark.parametrize("how", ["meta", "factory"])
def test_each_rank_allocates_only_its_parts(construction: list[dict[str, Any]], schedule: str, share: float,
                                            how: str) -> None:
    num_parts = 8 if schedule == "dualpipev" else 4
    whole = _whole_reference(num_parts, 11)
    whole_bytes = sum(p.numel() * p.element_size() for part in whole for p in part.parameters())
    part_bytes = whole_bytes // num_parts
    want = [fingerprint(part) for part in whole]
    ref = nn.Sequential(*whole)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, WIDE, generator=gen), torch.randn(16, WIDE, generator=gen)
    opt = _sgd(list(ref.parameters()))
    ref_losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = _mse(ref(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    for rank, res in enumerate(c[f"{schedule}-{how}"] for c in construction):
        assert res["params"] == share * whole_bytes, (rank, res)
        assert res["calls"] == sorted(set(res["held"].values()))  # built once per held part, no other
        # every new CPU byte during construction: this rank's parameters plus small bookkeeping
        # (handshake and replica-check messages), far less than any other part
        assert res["params"] <= res["bytes"] < res["params"] + part_bytes // 8, (rank, res["bytes"])
        for stage, group in res["held"].items():
            assert res["prints"][stage] == want[group], (rank, stage)
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-5)
    print(f"{schedule}/{how}: new CPU bytes per rank during construction "
          f"{[c[f'{schedule}-{how}']['bytes'] for c in construction]}, whole model {whole_bytes}")
