"""StageCompute: forward keeps only what backward needs; B equals I then W; loss and misuse checks."""

from __future__ import annotations

import copy

import pytest
import torch
from models import DIM, VOCAB, loss_fn, make_batch, make_parts
from torch import nn

from duplexpipe.runtime.stage_compute import StageCompute, TensorMeta
from duplexpipe.runtime.watchdog import PipelineError


def test_tensor_meta_describes_shape_and_dtype() -> None:
    meta = TensorMeta.of(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert meta == TensorMeta((2, 3), torch.bfloat16)
    assert str(meta) == "(2, 3) bfloat16"


def test_first_stage_takes_token_ids_and_keeps_no_input_leaf() -> None:
    stage = StageCompute(0, make_parts(2)[0], None)
    tokens, _ = make_batch(4, 0)
    leaf, out = stage.forward(tokens, 0, train=True)
    assert not leaf.requires_grad and out.shape == (4, tokens.shape[1], DIM)
    act = stage.keep(leaf, out, 0)
    assert act.inp is None and act.root_meta == TensorMeta.of(out)
    assert stage.backward(act, torch.ones_like(out)) is None
    assert all(p.grad is not None for p in stage.params())


def test_middle_stage_input_requires_grad_only_when_training() -> None:
    stage = StageCompute(1, make_parts(3)[1], None)
    x = torch.randn(2, 3, DIM)
    assert stage.forward(x, 0, train=True)[0].requires_grad
    assert not stage.forward(x, 0, train=False)[0].requires_grad


@pytest.mark.parametrize("last", [False, True], ids=["middle stage", "last stage"])
def test_backward_equals_input_then_weight(last: bool) -> None:
    part = make_parts(2, dtype=torch.float64)[1] if last else make_parts(3, dtype=torch.float64)[1]
    full, split = StageCompute(1, part, None), StageCompute(1, copy.deepcopy(part), None)
    x = torch.randn(3, 2, DIM, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (3, 2))
    grads = {}
    for name, stage in (("full", full), ("split", split)):
        leaf, out = stage.forward(x, 0, train=True)
        root = stage.loss(out, targets, loss_fn, 0) * 0.5 if last else out
        grad = None if last else torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        act = stage.keep(leaf, root, 0)
        if name == "full":
            grads[name] = stage.backward(act, grad)
        else:
            grads[name] = stage.backward_input(act, grad)
            assert all(p.grad is None for p in stage.params())
            stage.backward_weight(act, 0)
            assert act.weight_work is None
    torch.testing.assert_close(grads["split"], grads["full"], rtol=1e-12, atol=1e-12)
    for a, b in zip(full.params(), split.params(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12)


def test_weight_before_input_is_refused() -> None:
    stage = StageCompute(1, nn.Linear(DIM, DIM), None)
    leaf, out = stage.forward(torch.randn(2, DIM), 4, train=True)
    with pytest.raises(PipelineError, match="stage 1 microbatch 4: W ran before its I"):
        stage.backward_weight(stage.keep(leaf, out, 4), 4)


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def test_one_tensor_must_flow_between_stages() -> None:
    with pytest.raises(PipelineError, match="stage 2 microbatch 1: the module returned tuple; exactly one "
                                            "Tensor flows between stages"):
        StageCompute(2, _Pair(), None).forward(torch.zeros(1), 1, train=False)


def test_loss_must_be_a_scalar() -> None:
    stage = StageCompute(3, nn.Identity(), None)
    with pytest.raises(ValueError, match=r"stage 3 microbatch 0: loss_fn must return a scalar .*\(2,\)"):
        stage.loss(torch.zeros(2), torch.zeros(2), lambda out, tgt: out - tgt, 0)


def test_output_that_needs_no_gradient_is_refused() -> None:
    stage = StageCompute(1, nn.Identity(), None)
    leaf, out = stage.forward(torch.randn(2, DIM), 0, train=True)
    with pytest.raises(PipelineError, match="stage 1 microbatch 0: the output does not require grad"):
        stage.keep(leaf, out.detach(), 0)


def test_autocast_runs_the_forward_in_the_requested_dtype() -> None:
    stage = StageCompute(1, nn.Linear(DIM, DIM), torch.bfloat16)
    _, out = stage.forward(torch.randn(2, DIM), 0, train=True)
    assert out.dtype == torch.bfloat16
    assert next(stage.module.parameters()).dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_split_backward_on_cuda_matches_full_backward() -> None:
    device = torch.device("cuda")
    part = make_parts(3)[1].to(device)
    full, split = StageCompute(1, part, None), StageCompute(1, copy.deepcopy(part), None)
    x = torch.randn(4, 2, DIM, device=device)
    for stage in (full, split):
        leaf, out = stage.forward(x, 0, train=True)
        act = stage.keep(leaf, out, 0)
        if stage is full:
            stage.backward(act, torch.ones_like(out))
        else:
            stage.backward_input(act, torch.ones_like(out))
            stage.backward_weight(act, 0)
    for a, b in zip(full.params(), split.params(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)
