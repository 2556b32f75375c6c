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
