"""Tests for duplexpipe.tp.plans (one process, no process group): plan keys resolved as parallelize_module
resolves them, and a plan checked against the model before anything is sharded (missing modules, dimensions and
heads the TP degree does not divide, values that are no ParallelStyle)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from duplexpipe.launch.tasks.gpt import GPTConfig, build_gpt, gpt_tp_plan
from duplexpipe.model.split import build_parts, plan_partition
from duplexpipe.moe import moe_tp_plan
from duplexpipe.tp.plans import check_plan, plan_errors, resolve, sharded_over_tp, summary
from duplexpipe.tp.style import ScatterSequence


def _parts(n_head: int = 4, vocab: int = 16) -> list[nn.Module]:
    embedding, blocks, head = build_gpt(GPTConfig(vocab_size=vocab, block_size=8, d_model=16, n_head=n_head,
                                                  n_layer=4))
    partition = plan_partition(blocks, 2, "uniform", embedding=embedding, head=head)
    return list(build_parts(blocks, partition, embedding=embedding, head=head))


def test_keys_resolve_token_by_token_as_parallelize_module_does() -> None:
    first, last = _parts()
    assert [p for p, _ in resolve(first, "layer*.attn.q")] == ["layer0.attn.q", "layer1.attn.q"]
    assert [p for p, _ in resolve(last, "layer*.attn.q")] == ["layer2.attn.q", "layer3.attn.q"]
    assert [p for p, _ in resolve(first, "head.out")] == []
    assert [p for p, _ in resolve(last, "head.out")] == ["head.out"]
    assert [p for p, _ in resolve(first, "")] == [""]


def test_the_bundled_plans_fit_their_models() -> None:
    check_plan(_parts(), gpt_tp_plan(), 2)
    check_plan(_parts(), gpt_tp_plan(sequence_parallel=True), 4)
    plan = gpt_tp_plan(sequence_parallel=True)
    assert isinstance(plan["embedding"], ScatterSequence) and isinstance(plan["layer*.ln1"], SequenceParallel)
    assert set(moe_tp_plan("layer*", True, embedding="embedding", head="head")) >= {
        "layer*.mixer.q", "layer*.mixer.out", "layer*.norm1", "layer*.moe", "embedding", "head"}


def test_a_vocabulary_the_degree_does_not_divide_is_sharded_unevenly() -> None:
    """The embedding's rows and a gathered head's rows (8 + 7 of 15): nothing after them sees the local size."""
    plan = {**gpt_tp_plan(vocab_parallel=True), "embedding.tok": RowwiseParallel(input_layouts=Replicate())}
    check_plan(_parts(vocab=15), plan, 2)
    assert plan_errors(_parts(vocab=15), plan, 2)[1] == []


@pytest.mark.parametrize("plan, tp, message", [
    ({"layer*.attn.nope": ColwiseParallel()}, 2, r"names module\(s\) \['layer\*.attn.nope'\] that no model part has "
                                                 r"\(TP degree 2\)"),
    (gpt_tp_plan(), 3, r"part 0 module 'layer0.attn.q' \(Linear\) has out_features=16, not divisible by the TP "
                       r"degree 3"),
    ({**gpt_tp_plan(), "head.out": ColwiseParallel()}, 2, r"part 1 module 'head.out' \(Linear\) has out_features=15"),
    ({"layer*.attn.q": "colwise"}, 2, r"tp_plan\['layer\*.attn.q'\] must be a torch ParallelStyle"),
])
def test_a_plan_that_cannot_shard_the_model_is_refused_naming_module_size_and_degree(plan: dict[str, Any], tp: int,
                                                                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_plan(_parts(vocab=15), plan, tp)


def test_heads_around_a_sharded_projection_must_divide_by_the_degree() -> None:
    with pytest.raises(ValueError, match=r"module 'layer0.attn' \(CausalSelfAttention\) has n_head=2, not divisible "
                                         r"by the TP degree 4"):
        check_plan(_parts(n_head=2), gpt_tp_plan(), 4)


def test_a_callable_plan_is_trusted_or_checks_itself() -> None:
    seen: list[tuple[int, int]] = []

    class Checked:
        def __call__(self, part: nn.Module, tp_mesh: Any) -> None:
            raise AssertionError("not called by the check")

        def check(self, parts: Any, tp: int) -> None:
            seen.append((len(parts), tp))

    check_plan(_parts(), lambda part, mesh: None, 2)
    check_plan(_parts(), Checked(), 2)
    assert seen == [(2, 2)]
    with pytest.raises(ValueError, match="a dict of ParallelStyles or a callable"):
        check_plan(_parts(), 42, 2)  # type: ignore[arg-type]


def test_plain_tensors_are_whole_on_every_tp_rank_and_errors_are_summarised() -> None:
    assert not sharded_over_tp(torch.zeros(2))
    assert summary(["a", "b", "c", "d", "e"]) == "a; b; c; ... (2 more)"
    assert summary(["a"]) == "a"
