"""moe.linear: the Linear whose weight gradient an F&B pair may defer, against plain Linears, deferred inside a
pair (bit-equal to formed at once) and split into I and W, with and without a stage input gradient."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

from duplexpipe.moe import CausalSelfAttention, MoEBlock, MoELayer
from duplexpipe.runtime.backward.graph import stage_backward_input, stage_backward_weight
from duplexpipe.runtime.comm_points import CommSlot, Driver, current_driver, forward_slot
from duplexpipe.runtime.fb_pair import run_pair


@pytest.mark.parametrize("expert", ["swiglu", "mlp"])
def test_expert_gradients_equal_plain_linears(expert: str) -> None:
    torch.manual_seed(0)
    layer = MoELayer(8, 12, 4, 2, expert=expert).double()
    mine = layer.experts["0"]
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    mine(x).pow(2).sum().backward()
    w1, w2 = mine.w1.weight, mine.w2.weight
    w3 = mine.w3.weight if mine.w3 is not None else None
    plain = [w.detach().clone().requires_grad_(True) for w in (w1, w2, w3) if w is not None]
    x2 = x.detach().clone().requires_grad_(True)
    h = torch.nn.functional.linear(x2, plain[0])
    h = torch.nn.functional.silu(h) * torch.nn.functional.linear(x2, plain[2]) if w3 is not None else (
        torch.nn.functional.gelu(h))
    torch.nn.functional.linear(h, plain[1]).pow(2).sum().backward()
    for got, want in zip([w for w in (w1, w2, w3) if w is not None], plain, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)


def test_weight_gradients_deferred_in_a_pair_are_bit_equal_to_formed_at_once() -> None:
    block = _block()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    grads, pending = {}, {}
    for deferred in (False, True):
        block.zero_grad(set_to_none=True)
        slot, base = CommSlot(), Driver()
        with forward_slot(slot):
            y = block(x)

        def backward(y: torch.Tensor = y, slot: CommSlot = slot, base: Driver = base,
                     deferred: bool = deferred) -> None:
            slot.driver = current_driver(base)  # as the runtime points a forward's slot at the pair's backward
            y.pow(2).sum().backward()
            pending[deferred] = sorted(n for n, p in block.named_parameters() if p.grad is None)

        run_pair(backward, lambda: None, base, torch.device("cpu"), defer_weights=deferred)
        grads[deferred] = {name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None}
    assert not pending[False] and "mixer.q.bias" in pending[True] and "moe.experts.0.w1.weight" in pending[True]
    assert "norm2.weight" not in pending[True]  # a LayerNorm's gradient is formed by autograd, at once
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) == len(list(block.parameters()))
    assert all(torch.equal(grads[True][k], grads[False][k]) for k in grads[True])



def _block() -> MoEBlock:
    torch.manual_seed(0)
    return MoEBlock(8, MoELayer(8, 12, 4, 2, shared_experts=1), mixer=CausalSelfAttention(8, 2)).double()


@pytest.mark.parametrize("input_grad", [True, False])
def test_a_split_backward_forms_every_gradient_once(input_grad: bool) -> None:
    """I then W (as ZB schedules and DualPipe's deferred W run them) equals the full backward. Without a
    stage input gradient (a first stage) I has nothing to do and W runs the full graph, through the Linears'
    inputs to the parameters below them. The split itself tells the Linears which part runs (their nodes' marks):
    nothing is set on the slot."""
    block = _block()
    x, g = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    grads = {}
    for split in (False, True):
        block.zero_grad(set_to_none=True)
        x0, slot = x.clone().requires_grad_(input_grad), CommSlot()
        with forward_slot(slot):
            y = block(x0)
        if split:
            found, groups = stage_backward_input([get_gradient_edge(y)], [g], [x0] if input_grad else [],
                                                 list(block.parameters()))
            stage_backward_weight(groups)
            dx = found[0] if input_grad else None
        else:
            torch.autograd.backward(y, g)
            dx = x0.grad
        grads[split] = ({n: p.grad.clone() for n, p in block.named_parameters()}, dx)
    (full, dx_full), (parts, dx_parts) = grads[False], grads[True]
    assert full.keys() == parts.keys()
    for name in full:
        torch.testing.assert_close(parts[name], full[name], rtol=1e-12, atol=1e-14, msg=name)
    if input_grad:
        torch.testing.assert_close(dx_parts, dx_full, rtol=1e-12, atol=1e-14)
