"""The router: top-k of softmax or sigmoid scores, the bias that moves only the selection, the balance loss."""

from __future__ import annotations

import pytest
import torch

from duplexpipe.moe.router import Router, Routing, balance_loss


def _router(kind: str, experts: int = 4, k: int = 2) -> Router:
    torch.manual_seed(0)
    return Router(6, experts, k, kind).double()


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_top_k_of_the_scores(kind: str) -> None:
    router = _router(kind)
    x = torch.randn(10, 6, dtype=torch.float64)
    got = router(x)
    logits = router.gate(x)
    scores = logits.softmax(-1) if kind == "softmax" else logits.sigmoid()
    want = scores.topk(2, -1).indices
    assert torch.equal(got.experts, want)
    weights = scores.gather(-1, want)
    if kind == "sigmoid":  # DeepSeek-V3: normalised over the chosen experts
        weights = weights / weights.sum(-1, keepdim=True)
    torch.testing.assert_close(got.weights, weights)
    torch.testing.assert_close(got.affinity.sum(-1), torch.ones(10, dtype=torch.float64))


def test_the_bias_moves_the_selection_not_the_weights() -> None:
    router = _router("sigmoid")
    x = torch.randn(10, 6, dtype=torch.float64)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 10.0]))
    got = router(x)
    assert set(got.experts.flatten().tolist()) == {2, 3}
    scores = router.gate(x).sigmoid()
    chosen = scores.gather(-1, got.experts)
    torch.testing.assert_close(got.weights, chosen / chosen.sum(-1, keepdim=True))


def test_unknown_router_is_refused() -> None:
    with pytest.raises(ValueError, match="router must be one of .*got 'relu'"):
        Router(4, 4, 2, "relu")


def test_balance_loss_is_one_when_uniform_and_grows_when_skewed() -> None:
    uniform = Routing(torch.tensor([[0], [1], [2], [3]]), torch.ones(4, 1), torch.full((4, 4), 0.25))
    assert balance_loss(uniform, torch.tensor([1, 1, 1, 1])).item() == pytest.approx(1.0)
    skewed = Routing(torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1),
                     torch.tensor([[1.0, 0, 0, 0]] * 4))
    assert balance_loss(skewed, torch.tensor([4, 0, 0, 0])).item() == pytest.approx(4.0)
    empty = Routing(torch.zeros(0, 2, dtype=torch.long), torch.ones(0, 2), torch.zeros(0, 4, requires_grad=True))
    assert balance_loss(empty, torch.zeros(4, dtype=torch.long)).item() == 0.0


def test_group_limited_selection_keeps_to_the_best_groups() -> None:
    """DeepSeek-V3: a group scores as the sum of its two best biased scores; experts only from the best topk_group
    groups (brute force over every token)."""
    torch.manual_seed(1)
    router = Router(6, 8, 2, "sigmoid", groups=(4, 2)).double()
    router.expert_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    x = torch.randn(50, 6, dtype=torch.float64)
    got = router(x)
    biased = (router.gate(x).sigmoid() + router.expert_bias).detach()
    for token in range(50):
        groups = biased[token].view(4, 2).sum(-1)  # two experts a group: their top two is the group
        allowed = [e for g in groups.topk(2).indices.tolist() for e in (2 * g, 2 * g + 1)]
        want = sorted(allowed, key=lambda e: -float(biased[token, e]))[:2]
        assert sorted(got.experts[token].tolist()) == sorted(want)


def test_scaled_weights_and_the_dtypes_transformers_uses() -> None:
    """scores_dtype: the scores in float32 from float64 logits, weights back in float64; logits_dtype: the
    projection itself in float32 (DeepSeek-V3), weights stay float32; scale multiplies the normalised weights."""
    torch.manual_seed(2)
    x = torch.randn(7, 6, dtype=torch.float64)
    soft = Router(6, 4, 2, "softmax", True, scores_dtype=torch.float32, bias=False).double()
    got = soft(x)
    scores = soft.gate(x).float().softmax(-1)
    top = scores.topk(2, -1).values
    assert got.weights.dtype == torch.float64 and torch.equal(got.weights, (top / top.sum(-1, keepdim=True)).double())
    assert soft.expert_bias is None and "expert_bias" not in soft.state_dict()
    sig = Router(6, 4, 2, "sigmoid", logits_dtype=torch.float32, scale=2.5, eps=1e-20).double()
    out = sig(x)
    assert out.logits is not None and out.logits.dtype == torch.float32 and out.weights.dtype == torch.float32
    torch.testing.assert_close(out.weights.sum(-1), torch.full((7,), 2.5))


def test_bad_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="n_group=3 must divide num_experts=8"):
        Router(4, 8, 2, "sigmoid", groups=(3, 1))
    with pytest.raises(ValueError, match="topk_group=1 of n_group=4 groups leaves fewer than top_k=4"):
        Router(4, 8, 4, "sigmoid", groups=(4, 1))
