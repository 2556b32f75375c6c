"""Tests for duplexpipe.runtime.backward.checkpoint: a checkpointed region is recomputed once per backward, however
many engine calls the split backward makes (I, then one per param group at W), exactly; what only I needed is dropped
at I, what W needs is kept until W."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _counting import CountMatmuls
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from duplexpipe.runtime.backward.checkpoint import RecomputeWatch, _Region, checkpoint
from duplexpipe.runtime.backward.graph import stage_backward_input, stage_backward_weight

DIM = 8


class Counted(nn.Module):
    """A residual MLP block with a LayerNorm (three param groups) that counts its forward runs."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(dropout)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x)))))


def _model(n: int = 3, dropout: float = 0.0) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Counted(dropout) for _ in range(n)).double()


def _run(blocks: nn.ModuleList, x: torch.Tensor, ckpt: Callable[..., Any] | None, **kwargs: Any) -> torch.Tensor:
    for block in blocks:
        x = ckpt(block, x, **kwargs) if ckpt is not None else block(x)
    return x.square().sum()


def _split(blocks: nn.ModuleList, x: torch.Tensor, ckpt: Callable[..., Any] | None,
           **kwargs: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """I then W on the blocks; (d input, weight gradients)."""
    params = list(blocks.parameters())
    for p in params:
        p.grad = None
    leaf = x.detach().requires_grad_(True)
    loss = _run(blocks, leaf, ckpt, **kwargs)
    dx, work = stage_backward_input([get_gradient_edge(loss)], [torch.ones_like(loss)], [leaf], params)
    assert len(work.groups) == 3 * len(blocks)  # one W engine call per group
    stage_backward_weight(work)
    assert dx[0] is not None
    return dx[0], [p.grad for p in params]


def _reference(blocks: nn.ModuleList, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    plain = copy.deepcopy(blocks)
    leaf = x.detach().requires_grad_(True)
    grads = torch.autograd.grad(_run(plain, leaf, None), [leaf, *plain.parameters()])
    return grads[0], list(grads[1:])


def test_split_backward_recomputes_once_and_is_exact() -> None:
    blocks = _model()
    x = torch.randn(5, DIM, dtype=torch.float64)
    ref_dx, ref_grads = _reference(blocks, x)
    dx, grads = _split(blocks, x, checkpoint)
    assert [b.calls for b in blocks] == [2, 2, 2]  # the forward and one recompute, at I
    assert torch.equal(dx, ref_dx)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_torch_checkpoint_recomputes_in_every_engine_call() -> None:
    """What this module is for: torch's checkpoint recomputes at I and again in each W group's engine call."""
    blocks = _model()
    _split(blocks, torch.randn(5, DIM, dtype=torch.float64), torch_checkpoint, use_reentrant=False)
    assert [b.calls for b in blocks] == [5, 5, 5]  # forward, I, and one per param group (norm, up, down)


def test_plain_backward_and_dropout_are_exact() -> None:
    blocks = _model(dropout=0.3)
    x = torch.randn(5, DIM, dtype=torch.float64)
    torch.manual_seed(7)
    ref_dx, ref_grads = _reference(blocks, x)
    torch.manual_seed(7)
    leaf = x.detach().requires_grad_(True)
    grads = torch.autograd.grad(_run(blocks, leaf, checkpoint), [leaf, *blocks.parameters()])
    assert torch.equal(grads[0], ref_dx)  # the recompute drew the forward's dropout masks
    assert all(torch.equal(g, r) for g, r in zip(grads[1:], ref_grads, strict=True))
    assert [b.calls for b in blocks] == [2, 2, 2]


def test_what_only_i_needed_is_dropped_at_i(monkeypatch: pytest.MonkeyPatch) -> None:
    """After I, a region holds only what W unpacks (the tanh output, whose node runs only at I, is gone); after W,
    nothing."""
    holders: list[Any] = []
    pack = _Region.pack
    monkeypatch.setattr(_Region, "pack", lambda self, t: holders.append(pack(self, t)) or holders[-1])

    def fn(x: torch.Tensor, up: nn.Linear, down: nn.Linear) -> torch.Tensor:
        return down(torch.tanh(up(x)))

    torch.manual_seed(0)
    up, down = nn.Linear(DIM, 2 * DIM).double(), nn.Linear(2 * DIM, DIM).double()
    leaf = torch.randn(4, DIM, dtype=torch.float64, requires_grad=True)
    out = checkpoint(fn, leaf, up, down).sum()
    assert holders and all(h.tensor is None for h in holders)  # the forward kept nothing
    _, work = stage_backward_input([get_gradient_edge(out)], [torch.ones_like(out)], [leaf], [*up.parameters(),
                                                                                            *down.parameters()])
    kept = [h for h in holders if h.tensor is not None]
    assert 0 < len(kept) < len(holders)
    stage_backward_weight(work)
    assert all(h.tensor is None for h in holders)


def test_a_watch_sees_each_recompute_and_what_it_holds_until_w() -> None:
    """Regions made while a watch collects report each recompute (all three blocks' tensors held then, one block's
    more at each) and hold what W needs until W; a region made outside it is not watched."""
    blocks = _model()
    seen: list[int] = []
    watch = RecomputeWatch(on_recompute=lambda: seen.append(sum(t.numel() for t in watch.held())))
    params = list(blocks.parameters())
    leaf = torch.randn(5, DIM, dtype=torch.float64, requires_grad=True)
    with watch.collecting():
        loss = _run(blocks, leaf, checkpoint)
    assert len(watch.regions) == 3 and watch.held() == []  # the forward kept nothing
    _, work = stage_backward_input([get_gradient_edge(loss)], [torch.ones_like(loss)], [leaf], params)
    assert len(seen) == 3 and 0 < seen[0] < seen[1] < seen[2]  # the last block first; what W needs piles up
    assert 0 < sum(t.numel() for t in watch.held()) < seen[2]  # after I: what W needs, not what only I needed
    stage_backward_weight(work)
    assert watch.held() == []
    _split(blocks, leaf, checkpoint)
    assert len(seen) == 3  # outside `collecting`: not watched


def test_a_second_backward_recomputes_again() -> None:
    """A graph run twice (retain_graph): the second run finds its tensors dropped and recomputes, still exact."""
    blocks = _model(1)
    x = torch.randn(5, DIM, dtype=torch.float64, requires_grad=True)
    loss = _run(blocks, x, checkpoint)
    first = torch.autograd.grad(loss, x, retain_graph=True)[0]
    second = torch.autograd.grad(loss, x)[0]
    assert torch.equal(first, second) and blocks[0].calls == 3


def _matmuls(fn: Callable[[], None]) -> int:
    """The matmuls `fn` runs (forward, recompute and backward)."""
    with CountMatmuls() as counter:
        fn()
    return counter.count


def _save_matmuls() -> tuple[Any, Any]:
    saved = (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
    return create_selective_checkpoint_contexts(
        lambda ctx, func, *args, **kwargs: CheckpointPolicy.MUST_SAVE if func in saved
        else CheckpointPolicy.PREFER_RECOMPUTE)


def test_selective_saves_the_matmuls() -> None:
    """Selective contexts run once under the split backward, exactly, and the recompute runs no matmul (their
    outputs were saved); torch's checkpoint refuses them there (its second recompute, at W)."""
    x = torch.randn(5, DIM, dtype=torch.float64)
    blocks = _model()
    ref_dx, ref_grads = _reference(blocks, x)
    matmuls: dict[str, int] = {}
    for name, kwargs in (("full", {}), ("selective", {"context_fn": _save_matmuls})):
        def step(kwargs: dict[str, Any] = kwargs) -> None:
            dx, grads = _split(blocks, x, checkpoint, **kwargs)
            assert torch.equal(dx, ref_dx)
            assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
        matmuls[name] = _matmuls(step)
    assert matmuls["selective"] < matmuls["full"], matmuls
    with pytest.raises(RuntimeError, match="backward an extra time"):
        _split(blocks, x, torch_checkpoint, use_reentrant=False, context_fn=_save_matmuls)


def test_a_watch_holds_what_the_selective_cache_keeps_until_the_recompute_takes_it() -> None:
    """Under the selective policy the forward's matmul outputs wait in the policy's cache: the watch counts them
    (measured memory sees them) until the recompute hands them to its holders; an output the backward never takes
    (the down projection's, summed into the residual) stays in the cache until the graph goes."""
    from duplexpipe.model.stages import selective_context
    from duplexpipe.runtime.backward.checkpoint import cached
    from duplexpipe.runtime.saved_bytes import storage_key

    torch.manual_seed(0)
    width, rows = 8, 6
    norm, up, down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def block(x: torch.Tensor) -> torch.Tensor:
        return x + down(nn.functional.gelu(up(norm(x))))

    x = torch.randn(rows, width, requires_grad=True)
    watch = RecomputeWatch()
    with watch.collecting():
        out = checkpoint(block, x, context_fn=selective_context)
    (region,) = [ref() for ref in watch.regions]
    assert region is not None

    def nbytes(tensors: list[torch.Tensor]) -> int:
        return sum(dict(map(storage_key, tensors)).values())

    assert nbytes(watch.held()) == nbytes(cached(region.recompute_context)) == rows * (4 * width + width) * 4
    weights = [p for module in (norm, up, down) for p in module.parameters()]
    _, work = stage_backward_input([get_gradient_edge(out)], [torch.ones_like(out)], [x], weights)
    assert nbytes(cached(region.recompute_context)) == rows * width * 4  # the down projection's output alone
    assert nbytes(watch.held()) > nbytes(cached(region.recompute_context))  # what W needs, recomputed
    stage_backward_weight(work)


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("split", [False, True])
def test_nothing_of_a_region_outlives_its_backward(policy: str, split: bool) -> None:
    """After the backward every region, its inputs and its recomputed tensors are freed (a hook that stops the
    recompute by raising is kept alive by autograd: it must hold nothing; before, each region leaked with its
    recompute's graph, about 30 MB a step on the GPT example)."""
    blocks = _model()
    kwargs: dict[str, Any] = {"context_fn": _save_matmuls} if policy == "selective" else {}
    for _ in range(2):  # the first run warms up what torch caches once
        x = torch.randn(5, DIM, dtype=torch.float64, requires_grad=True)
        inputs, watch = weakref.ref(x), RecomputeWatch()
        with watch.collecting():
            if split:
                _split(blocks, x, checkpoint, **kwargs)
            else:
                _run(blocks, x, checkpoint, **kwargs).backward()
        del x
        gc.collect()
        assert len(watch.regions) == len(blocks) and all(region() is None for region in watch.regions)
        assert inputs() is None
