"""Tests for duplexpipe.launch.job_guards: the batch fingerprint tells batches apart (values, shapes, dtypes,
structure), and a `task.batch()` that differs between ranks is named on every rank with the ranks that agree."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from duplexpipe.launch.job_guards import batch_fingerprint, check_same_batch, checks_batch
from duplexpipe.launch.processes import launch


def test_the_fingerprint_sees_values_shapes_dtypes_and_structure() -> None:
    x, y = torch.arange(6.0).view(2, 3), torch.zeros(2, dtype=torch.int64)
    base = batch_fingerprint(x, y)
    assert base == batch_fingerprint(x.clone(), y.clone())
    changed = x.clone()
    changed[1, 2] += 1e-6
    others = [batch_fingerprint(changed, y), batch_fingerprint(x.view(3, 2), y), batch_fingerprint(x.double(), y),
              batch_fingerprint({"x": x}, y), batch_fingerprint(x, None)]
    assert len({base, *others}) == 6


def test_which_steps_are_checked() -> None:
    assert [checks_batch("first", s, 3) for s in (3, 4)] == [True, False]
    assert checks_batch("every", 9, 3) and not checks_batch("never", 3, 3)


def _compare() -> list[str]:
    out = []
    for seeded_by_rank in (False, True):
        seed = dist.get_rank() % 2 if seeded_by_rank else 0  # ranks 0, 2 and 1 draw alike
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        try:
            check_same_batch(0, 4, x, x.sum(1), torch.device("cpu"), lambda work, what: work.wait())
            out.append("")
        except ValueError as exc:
            out.append(str(exc))
    return out


@pytest.mark.timeout(90)
def test_a_batch_that_differs_between_ranks_is_named_on_every_rank() -> None:
    results: list[Any] = launch(_compare, 3, start_method="forkserver")
    assert [same for same, _ in results] == [""] * 3
    differ = {message for _, message in results}
    assert len(differ) == 1, differ
    assert differ.pop().startswith("step 0: task.batch(0, 4) returned different batches on different ranks (ranks "
                                   "[0, 2]; ranks [1] agree); batch() must return the same global batch on every rank")
