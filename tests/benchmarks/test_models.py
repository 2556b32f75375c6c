"""benchmarks.models: the sleep model splits I from W, the single-process reference gradients, the two sides."""

from __future__ import annotations

import pytest
import torch

from benchmarks import models


def test_sleep_part_splits_input_and_weight_gradients() -> None:
    part = models.SleepPart(4, 0.0, 0.0, 0.0)
    x = torch.randn(3, 4, requires_grad=True)
    y = part(x)
    (dx,) = torch.autograd.grad(y, [x], torch.ones_like(y), retain_graph=True)
    assert part.bias.grad is None and torch.equal(dx, torch.ones_like(x))
    (db,) = torch.autograd.grad(y, [part.bias], torch.ones_like(y))
    assert torch.equal(db, torch.full((4,), 3.0))


def test_reference_grads_mean_over_microbatches() -> None:
    spec = models.ModelSpec("mlp", num_layers=2, width=3, batch=4)
    parts = models.build_parts(spec, 2)
    x, y = models.make_batch(spec)
    grads, loss = models.reference_grads(parts, x, y, 2)
    whole = torch.nn.Sequential(*parts)
    pairs = zip(x.tensor_split(2), y.tensor_split(2), strict=True)
    expected = torch.stack([models.loss_fn(whole(a), b) for a, b in pairs]).mean()
    assert loss == pytest.approx(float(expected.detach()))
    expected.backward()
    first_weight = next(parts[0].parameters())
    assert first_weight.grad is not None and torch.allclose(grads[0][0], first_weight.grad)
    assert models.max_rel_error(grads[0], grads[0]) == 0.0


def test_parts_are_the_same_for_one_spec_and_refuse_an_uneven_split() -> None:
    spec = models.ModelSpec("transformer", num_layers=2, width=8, heads=2, batch=2, seq=3)
    a, b = models.build_parts(spec, 2), models.build_parts(spec, 2)
    assert all(torch.equal(p, q) for pa, pb in zip(a, b, strict=True)
               for p, q in zip(pa.parameters(), pb.parameters(), strict=True))
    assert models.make_batch(spec)[0].shape == (2, 3, 8)
    with pytest.raises(ValueError, match="do not split evenly"):
        models.build_parts(spec, 3)
    with pytest.raises(ValueError, match="unknown model kind"):
        models.build_parts(models.ModelSpec("cnn", num_layers=2), 2)


def test_torch_schedules_place_their_stages_as_duplexpipe_does() -> None:
    assert models.num_stages("1f1b", 4) == 4 and models.num_stages("zbv", 4) == 8
    with pytest.raises(ValueError, match="no torch schedule"):
        models.build_torch_pipe("dualpipe", [], 0, 2, 4, models.loss_fn)
