"""The step object and its helpers: microbatch splitting, shape signatures; a step starts empty."""

from __future__ import annotations

import pytest
import torch

from duplexpipe.runtime.collectives import Agreement
from duplexpipe.runtime.messages import Mailbox
from duplexpipe.runtime.rankplan import RankPlan
from duplexpipe.runtime.stage_compute import Activations
from duplexpipe.runtime.step import Step, microbatch_rows, signature, split_batch
from duplexpipe.runtime.timing import Tracer
from duplexpipe.schedules.lower import lower
from duplexpipe.schedules.registry import build


@pytest.mark.parametrize("batch, m", [(10, 4), (8, 4), (4, 4), (13, 5)])
def test_rows_match_tensor_split(batch: int, m: int) -> None:
    chunks = split_batch(torch.arange(batch), m, "inputs")
    assert [len(c) for c in chunks] == microbatch_rows(batch, m)
    assert sum(microbatch_rows(batch, m)) == batch
    assert torch.equal(torch.cat(chunks), torch.arange(batch))


def test_split_rejects_too_few_rows_and_non_batches() -> None:
    with pytest.raises(ValueError, match="inputs have 3 rows, fewer than the 4 microbatches"):
        split_batch(torch.zeros(3, 2), 4, "inputs")
    with pytest.raises(ValueError, match="targets must be a tensor with the batch along dim 0, got a 0-d"):
        split_batch(torch.tensor(1.0), 4, "targets")
    with pytest.raises(ValueError, match=r"inputs\[0\] is int, not a tensor"):
        split_batch([1, 2], 1, "inputs")
    with pytest.raises(ValueError, match=r'inputs\["mask"\] has 3 rows but inputs\["x"\] has 4'):
        split_batch({"x": torch.zeros(4, 2), "mask": torch.zeros(3)}, 2, "inputs")


def test_structures_split_leaf_by_leaf() -> None:
    x, mask = torch.arange(10.0).view(5, 2), torch.arange(5)
    for value in ((x, mask), [x, mask], {"x": x, "mask": mask}):
        chunks = split_batch(value, 2, "inputs")
        assert type(chunks[0]) is type(value) and len(chunks) == 2
        leaves = list(chunks[1].values()) if isinstance(value, dict) else list(chunks[1])
        assert torch.equal(leaves[0], x[3:]) and torch.equal(leaves[1], mask[3:])


def test_signature_depends_on_form_shapes_dtypes_and_microbatches_only() -> None:
    a = signature(torch.zeros(10, 3), 4)
    assert a == signature(torch.ones(10, 3), 4)
    assert a != signature(torch.zeros(11, 3), 4) and a != signature(torch.zeros(10, 3), 5)
    assert a != signature(torch.zeros(10, 3, dtype=torch.int64), 4)
    assert 0 <= a < 2**60
    pair = signature((torch.zeros(10, 3), torch.zeros(10)), 4)
    assert pair != signature([torch.zeros(10, 3), torch.zeros(10)], 4)
    assert pair != signature({"a": torch.zeros(10, 3), "b": torch.zeros(10)}, 4)


def test_a_step_starts_empty_and_names_its_agreement() -> None:
    schedule = lower(build("1f1b", 2, 4))
    agreed = Agreement(batch=8, signature=7, target_rows=8, error_rank=-1, consistent=True)
    step = Step(train=True, number=1, agreement=agreed, plan=RankPlan.of(schedule, 0), weights=[0.25] * 4,
                loss_scale=1.0, inputs={}, targets={}, loss=None, mail=Mailbox.of(1, True, None),
                acts=Activations(0), trace=Tracer(0, torch.device("cpu"), enabled=False))
    assert step.signature == 7 and step.mail.learning and not step.mail.leftovers()
    assert not step.acts.left() and (step.acts.live, step.acts.peak) == (0, 0)
    assert step.outputs == {} and step.exchanges == [] and step.set_aside == {}
