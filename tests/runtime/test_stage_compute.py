"""StageCompute: forward keeps only what backward needs; B equals I then W; structures; loss and misuse checks; what a
step holds for backward per stage and microbatch (Activations), its counts, and the one check that B, I or W has it."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from models import DIM, VOCAB, loss_fn, make_batch, make_parts
from torch import nn

from duplexpipe.comm.codec import TensorSpec
from duplexpipe.errors import ActivationShapeError, PipelineError
from duplexpipe.runtime.message_meta import Message
from duplexpipe.runtime.stage_compute import Activations, StageCompute
from duplexpipe.runtime.structure import TENSOR, flatten
from duplexpipe.schedules.ir import Action, Op


def _grad(x: torch.Tensor) -> Message:
    """A message of one tensor that carries a gradient back (a middle stage's input)."""
    return Message(TENSOR, [x], (True,))


def test_tensor_meta_describes_shape_and_dtype() -> None:
    meta = TensorSpec.of(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert meta == TensorSpec((2, 3), torch.bfloat16)
    assert str(meta) == "(2, 3) bfloat16"


def test_first_stage_takes_token_ids_and_keeps_no_input_leaf() -> None:
    stage = StageCompute(0, make_parts(2)[0], None)
    tokens, _ = make_batch(4, 0)
    inputs, out = stage.forward(Message.single(tokens), train=True)
    assert inputs == [] and out.shape == (4, tokens.shape[1], DIM)
    act = stage.keep(inputs, [out], 0)
    assert act.inputs == [] and act.root_metas == [TensorSpec.of(out)]
    assert stage.backward(act, [torch.ones_like(out)]) == []
    assert all(p.grad is not None for p in stage.params())


def test_first_stage_float_input_takes_no_gradient() -> None:
    stage = StageCompute(0, nn.Linear(DIM, DIM), None)
    inputs, out = stage.forward(Message.single(torch.randn(2, DIM)), train=True)
    assert inputs == [] and out.requires_grad


def test_middle_stage_input_requires_grad_only_when_training() -> None:
    stage = StageCompute(1, make_parts(3)[1], None)
    x = torch.randn(2, 3, DIM)
    assert stage.forward(_grad(x), train=True)[0][0].requires_grad
    assert stage.forward(_grad(x), train=False)[0] == []


@pytest.mark.parametrize("last", [False, True], ids=["middle stage", "last stage"])
def test_backward_equals_input_then_weight(last: bool) -> None:
    part = make_parts(2, dtype=torch.float64)[1] if last else make_parts(3, dtype=torch.float64)[1]
    full, split = StageCompute(1, part, None), StageCompute(1, copy.deepcopy(part), None)
    x = torch.randn(3, 2, DIM, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (3, 2))
    grads = {}
    for name, stage in (("full", full), ("split", split)):
        inputs, out = stage.forward(_grad(x), train=True)
        root = stage.loss(out, targets, loss_fn, 0) * 0.5 if last else out
        grad = None if last else [torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)]
        act = stage.keep(inputs, [root], 0)
        if name == "full":
            grads[name] = stage.backward(act, grad)
        else:
            grads[name] = stage.backward_input(act, grad)
            assert all(p.grad is None for p in stage.params())
            stage.backward_weight(act)
            assert act.weight_work is None
    torch.testing.assert_close(grads["split"], grads["full"], rtol=1e-12, atol=1e-12)
    for a, b in zip(full.params(), split.params(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12)


class _TwoInTwoOut(nn.Module):
    """(h, mask, unused) -> {"h": ..., "g": ..., "mask": ...}: the third input reaches no output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM).double()

    def forward(self, h: torch.Tensor, mask: torch.Tensor, unused: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.lin(h) * mask.unsqueeze(-1)
        return {"h": torch.tanh(y), "g": y * 2, "mask": mask}


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
def test_structures_flow_with_gradients_for_the_floats_that_require_grad(split: bool) -> None:
    stage = StageCompute(1, _TwoInTwoOut(), None)
    h, unused = torch.randn(3, DIM, dtype=torch.float64), torch.randn(3, DIM, dtype=torch.float64)
    mask = torch.tensor([1, 0, 1])
    message = Message(flatten((h, mask, unused), "in")[0], [h, mask, unused], (True, False, True))
    inputs, out = stage.forward(message, train=True)
    produced = stage.message(out, 0, train=True)
    assert produced.form == flatten({"h": h, "g": h, "mask": mask}, "out")[0] and produced.grads == (True, True, False)
    act = stage.keep(inputs, [t for t, g in zip(produced.leaves, produced.grads, strict=True) if g], 0)
    grads = [torch.ones_like(produced.leaves[0]), torch.ones_like(produced.leaves[1])]
    if split:
        got = stage.backward_input(act, grads)
        stage.backward_weight(act)
    else:
        got = stage.backward(act, grads)
    leaf = h.clone().requires_grad_(True)
    y = stage.module.lin(leaf) * mask.unsqueeze(-1)
    (torch.tanh(y).sum() + (2 * y).sum()).backward()
    assert len(got) == 2
    torch.testing.assert_close(got[0], leaf.grad, rtol=0, atol=0)
    assert torch.equal(got[1], torch.zeros_like(unused))  # reached no output: zeros go back


@pytest.mark.parametrize("out, path", [((torch.zeros(1), None), "out[1]"),
                                       ({"h": torch.zeros(1), "mask": 3}, 'out["mask"]'),
                                       ([], "out")])
def test_a_non_tensor_output_names_stage_microbatch_and_path(out: object, path: str) -> None:
    with pytest.raises(PipelineError, match=rf"stage 2 microbatch 1: the module's output {re.escape(path)} is"):
        StageCompute(2, nn.Identity(), None).message(out, 1, train=True)


def test_b_i_and_w_need_their_pending_activation() -> None:
    """The one home of "W without I" (and B or I without F, W twice): the step's activations."""
    stage, acts = StageCompute(1, nn.Linear(DIM, DIM), None), Activations(rank=3)
    inputs, out = stage.forward(_grad(torch.randn(2, DIM)), train=True)
    with pytest.raises(PipelineError, match="rank 3: 1W4 runs without a pending 1I4"):
        acts.pending(Action(1, Op.W, 4))
    with pytest.raises(PipelineError, match="rank 3: 1I4 runs without a pending forward 1F4"):
        acts.pending(Action(1, Op.I, 4))
    act = stage.keep(inputs, [out], 4)
    acts.hold(1, 4, act)
    with pytest.raises(PipelineError, match="rank 3: 1W4 runs without a pending 1I4"):
        acts.pending(Action(1, Op.W, 4))
    assert acts.pending(Action(1, Op.I, 4)) is act
    stage.backward_input(act, [torch.ones(2, DIM)])
    with pytest.raises(PipelineError, match="rank 3: 1B4 runs without a pending forward 1F4"):
        acts.pending(Action(1, Op.B, 4))
    assert acts.pending(Action(1, Op.W, 4)) is act


def test_a_step_holds_its_activations_per_stage_and_microbatch_and_counts_them() -> None:
    acts = Activations()
    first = StageCompute(0, nn.Linear(DIM, DIM), None)
    inputs, out = first.forward(_grad(torch.randn(2, DIM)), train=True)
    kept = [first.keep(inputs, [out], 0) for _ in range(3)]
    for mb, (stage, act) in enumerate(zip((0, 2, 0), kept, strict=True)):
        act.saved_bytes = 10 * (mb + 1)
        acts.hold(stage, mb, act)
    assert sorted(acts.held) == [(0, 0), (0, 2), (2, 1)]
    assert (acts.live, acts.peak, acts.live_bytes, acts.peak_bytes) == (3, 3, 60, 60)
    acts.release(0, 0, kept[0])
    acts.release(2, 1, kept[1])
    assert (acts.live, acts.peak, acts.live_bytes, acts.peak_bytes) == (1, 3, 30, 60)
    assert acts.left() == ["backward (B, or W after I) never ran for stage 0 microbatch 2"]
    acts.release(0, 2, kept[2])
    assert acts.left() == [] and (acts.live, acts.peak) == (0, 3)


def test_activations_left_lists_every_stage_and_microbatch_in_order() -> None:
    acts, stage = Activations(), StageCompute(1, nn.Identity(), None)
    inputs, out = stage.forward(_grad(torch.randn(2, DIM)), train=True)
    for s, mb in ((3, 2), (1, 4), (3, 0)):
        acts.hold(s, mb, stage.keep(inputs, [out], mb))
    assert acts.left() == ["backward (B, or W after I) never ran for stage 1 microbatch 4, "
                           "stage 3 microbatch 0, stage 3 microbatch 2"]

def test_loss_must_be_a_scalar() -> None:
    stage = StageCompute(3, nn.Identity(), None)
    with pytest.raises(ValueError, match=r"stage 3 microbatch 0: loss_fn must return a scalar .*\(2,\)"):
        stage.loss(torch.zeros(2), torch.zeros(2), lambda out, tgt: out - tgt, 0)


def test_output_that_needs_no_gradient_is_refused() -> None:
    stage = StageCompute(1, nn.Identity(), None)
    inputs, out = stage.forward(_grad(torch.randn(2, DIM)), train=True)
    with pytest.raises(PipelineError, match="stage 1 microbatch 0: the output does not require grad"):
        stage.keep(inputs, [], 0)


def test_autocast_runs_the_forward_in_the_requested_dtype() -> None:
    stage = StageCompute(1, nn.Linear(DIM, DIM), torch.bfloat16)
    _, out = stage.forward(_grad(torch.randn(2, DIM)), train=True)
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
        inputs, out = stage.forward(_grad(x), train=True)
        act = stage.keep(inputs, [out], 0)
        if stage is full:
            stage.backward(act, [torch.ones_like(out)])
        else:
            stage.backward_input(act, [torch.ones_like(out)])
            stage.backward_weight(act)
    for a, b in zip(full.params(), split.params(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)


def test_a_loss_input_with_other_rows_than_its_targets_is_refused() -> None:
    """A stage that returns 1 row for a microbatch of 4 would broadcast in the loss: named, with the rows; a last
    stage that returns None is named too."""
    stage = StageCompute(3, nn.Linear(DIM, DIM), None)
    targets = torch.zeros(4, DIM)
    with pytest.raises(ActivationShapeError, match=r"stage 3 microbatch 2: the loss input \(this last stage's "
                                                   r"output\) has 1 rows but its targets have 4: a stage changed"):
        stage.loss(torch.zeros(1, DIM), targets, torch.nn.functional.mse_loss, 2)
    structured = stage.loss({"logits": torch.zeros(4, DIM)}, {"labels": targets},
                            lambda out, t: torch.nn.functional.mse_loss(out["logits"], t["labels"]), 0)
    assert structured.item() == 0.0  # rows agree: structures of any form pass
    assert stage.loss(torch.zeros(4, DIM), torch.zeros(()), lambda o, t: o.sum() * t, 0).item() == 0.0  # no rows
    with pytest.raises(PipelineError, match=r"stage 3 microbatch 1: the module's output is NoneType; expected"):
        stage.loss(None, targets, torch.nn.functional.mse_loss, 1)
