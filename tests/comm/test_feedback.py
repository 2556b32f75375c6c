"""Tests for duplexpipe.comm.feedback: exact error feedback, staged commit and rollback, state dicts."""

from __future__ import annotations

import pytest
import torch

from duplexpipe.comm.feedback import ErrorFeedback, StagedState
from duplexpipe.comm.quantize import dequantize_int8, quantize_int8
from duplexpipe.comm.sparsify import random_k, threshold, top_k


def _grads(steps: int, n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen, dtype=torch.float64) * (1 + k) for k in range(steps)]


@pytest.mark.parametrize("method", ["topk", "randomk", "threshold", "int8"])
def test_transmitted_plus_residual_is_the_gradient_sum(method: str) -> None:
    """Over K steps: sum of what was transmitted + final residual == sum of gradients (float64, 1e-12);
    for the sparsifiers each step's identity holds bit for bit."""
    fb, gen = ErrorFeedback(), torch.Generator().manual_seed(1)
    grads = _grads(20, 300, 0)
    sent = torch.zeros(300, dtype=torch.float64)
    for g in grads:
        acc = fb.compensate(0, g, torch.float64)
        before = acc.clone()
        if method == "int8":
            codes, scales = quantize_int8(acc, 16, gen)
            out = dequantize_int8(codes, scales, 16, torch.float64)
            fb.keep_difference(0, acc, out)
        else:
            if method == "topk":
                sel = top_k(acc, 15)
            elif method == "randomk":
                sel = random_k(acc, 15, gen)
            else:
                sel = threshold(acc, 15, 0.3)
            out = torch.zeros_like(acc).index_add_(0, sel.indices, sel.values)
            fb.keep_rest(0, acc, sel.chosen)
            assert torch.equal(out + fb.staged(0), before)  # bit for bit
        assert not torch.equal(out, before)  # lossy: something is left behind
        fb.commit()
        sent += out
    residual = fb.get(0)
    assert residual is not None and residual.abs().max() > 0
    want = torch.stack(grads).sum(0)
    assert (sent + residual - want).abs().max().item() <= 1e-12 * want.abs().max().item()


def test_rollback_leaves_the_residual_untouched_and_commit_replaces_it() -> None:
    fb = ErrorFeedback()
    fb.keep_difference(3, torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64))
    fb.commit()
    acc = fb.compensate(3, torch.ones(4), torch.float64)
    assert torch.equal(acc, torch.full((4,), 2.0, dtype=torch.float64))
    fb.keep_rest(3, acc, torch.tensor([0, 1]))
    fb.rollback()
    assert torch.equal(fb.get(3), torch.ones(4, dtype=torch.float64)) and fb.staged(3) is None
    acc = fb.compensate(3, torch.ones(4), torch.float64)
    fb.keep_rest(3, acc, torch.tensor([0]))
    fb.commit()
    assert torch.equal(fb.get(3), torch.tensor([0.0, 2.0, 2.0, 2.0], dtype=torch.float64))


def test_residual_shape_is_checked_and_state_dict_round_trips() -> None:
    fb = ErrorFeedback("int8 residual")
    fb.stage(1, torch.arange(3.0))
    fb.commit()
    with pytest.raises(ValueError, match="int8 residual: bucket 1 has 4 elements but its residual has 3"):
        fb.compensate(1, torch.ones(4), torch.float32)
    state = fb.state_dict()
    other = StagedState("copy")
    other.load_state_dict({"1": state[1]})  # keys as a checkpoint may hand them back
    assert torch.equal(other.get(1), torch.arange(3.0))
    state[1].zero_()  # a clone: the live residual is not aliased
    assert torch.equal(fb.get(1), torch.arange(3.0))
