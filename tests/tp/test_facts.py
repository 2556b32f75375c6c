"""Tests for duplexpipe.tp.facts, what a TP plan does to each part, for the planner: the collectives counted from the
plan's styles with the bytes of the whole activations, the parameters it leaves whole, the degrees it can shard, and
plans that cannot say."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from duplexpipe.launch.tasks.gpt import GPTConfig, build_gpt, gpt_tp_plan
from duplexpipe.model.split import build_parts, plan_partition
from duplexpipe.planner.profile import TPFacts
from duplexpipe.tp.facts import part_styles, tp_degrees, tp_facts


def _parts(n_head: int = 4) -> list[nn.Module]:
    cfg = GPTConfig(vocab_size=11, block_size=8, d_model=16, n_head=n_head, n_layer=2)
    embedding, blocks, head = build_gpt(cfg)
    partition = plan_partition(blocks, 2, "uniform", embedding=embedding, head=head)
    return list(build_parts(blocks, partition, embedding=embedding, head=head))


def _replicated(part: nn.Module) -> int:
    """Bytes of what the GPT plan leaves whole: every parameter but q, k, v, proj.weight, mlp.0 and mlp.2.weight."""
    sharded = ("attn.q.", "attn.k.", "attn.v.", "attn.proj.weight", "mlp.0.", "mlp.2.weight")
    return sum(p.numel() * 4 for n, p in part.named_parameters() if not any(s in n for s in sharded))


def test_the_gpt_plan_counts_megatrons_row_collectives_and_dtensors_column_ones() -> None:
    parts = _parts()
    x = torch.randint(0, 11, (3, 8))
    for sp in (False, True):
        facts = tp_facts(parts, x, gpt_tp_plan(sp))
        assert facts is not None
        activation = 3 * 8 * 16 * 4  # (batch, sequence, d_model) float32: what each collective reduces
        for part, got in zip(parts, facts, strict=True):
            # one block per part: attention's and the MLP's output projections forward; q, k, v and mlp.0's
            # input gradients backward (torch's separate projections; Megatron's fused QKV would make it 2)
            assert got == TPFacts(2, 2 * activation, 4, 4 * activation, _replicated(part))


def test_degrees_follow_the_heads_and_callable_plans_without_styles_say_nothing() -> None:
    assert tp_degrees(_parts(n_head=4), gpt_tp_plan()) == (2, 4)
    assert tp_degrees(_parts(n_head=2), gpt_tp_plan()) == (2,)

    def by_hand(part: nn.Module, mesh: Any) -> None:
        """A callable plan: the planner cannot tell what it shards."""
    assert part_styles(_parts()[0], by_hand) is None
    assert tp_facts(_parts(), torch.randint(0, 11, (3, 8)), by_hand) is None
    assert set(part_styles(_parts()[0], gpt_tp_plan()) or {}) == {"layer0.attn.q", "layer0.attn.k", "layer0.attn.v",
                                                                   "layer0.attn.proj", "layer0.mlp.0", "layer0.mlp.2"}


def test_a_hugging_face_plan_names_its_styles_and_its_degrees_follow_the_kv_heads() -> None:
    from _hf_helpers import tiny_llama

    from duplexpipe.model.hf import causal_lm_parts
    from duplexpipe.model.hf_tp import HFTensorPlan

    parts = causal_lm_parts(tiny_llama(layers=2), 2)
    plan = HFTensorPlan()
    facts = tp_facts(parts, torch.randint(0, 96, (2, 8)), plan)
    assert facts is not None
    # part 0: the vocabulary-parallel embedding's output and a layer's o_proj and down_proj forward; q, k, v, gate
    # and up backward. Part 1: a layer, and the head (column-parallel, its logits gathered, its input's gradient)
    assert [(f.forward_collectives, f.backward_collectives) for f in facts] == [(3, 5), (3, 6)]
    assert tp_degrees(parts, plan) == (2,)  # 2 KV heads
