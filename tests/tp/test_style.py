"""Tests for duplexpipe.tp.style (one process, no process group): `ReplicatedWithGradAllReduce` marks a module whose
plain parameters' gradients are partial over TP and leaves its forward alone; `ScatterSequence` refuses an output
whose sequence the TP degree does not divide, naming module, length, dimension and degree. Their effect on a
sharded model (gradients summed over TP, the sequence scattered and gathered) is tested against one process in
tests/tp/test_parallelize.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from duplexpipe.tp.plans import partial_modules, partial_params
from duplexpipe.tp.style import PARTIAL_OVER_TP, ReplicatedWithGradAllReduce, ScatterSequence


class _Mesh:
    """What the styles ask of a 1-D TP mesh before any collective: its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _mesh(size: int) -> Any:
    return _Mesh(size)


def test_replicated_with_grad_all_reduce_marks_the_module_and_changes_no_forward() -> None:
    torch.manual_seed(0)
    norm, other = nn.LayerNorm(4), nn.Linear(4, 4)
    part = nn.Sequential(norm, other, nn.Sequential(norm))  # the norm twice: its parameters counted once
    x = torch.randn(2, 3, 4)
    before = part(x)
    assert ReplicatedWithGradAllReduce()._apply(norm, _mesh(2)) is norm
    assert getattr(norm, PARTIAL_OVER_TP) and not hasattr(other, PARTIAL_OVER_TP)
    assert torch.equal(part(x), before)
    assert partial_modules(part) == [norm]
    assert [id(p) for p in partial_params(partial_modules(part) * 2)] == [id(norm.weight), id(norm.bias)]


def test_scatter_sequence_refuses_a_sequence_the_degree_does_not_divide() -> None:
    embedding = nn.Embedding(8, 4)
    assert ScatterSequence()._apply(embedding, _mesh(2)) is embedding
    with pytest.raises(ValueError, match=r"sequence parallelism: the output of Embedding has 3 positions along "
                                         r"dim 1, not divisible by the TP degree 2"):
        embedding(torch.zeros(2, 3, dtype=torch.long))
    column = nn.Linear(4, 4)
    ScatterSequence(sequence_dim=0)._apply(column, _mesh(4))
    with pytest.raises(ValueError, match="has 6 positions along dim 0, not divisible by the TP degree 4"):
        column(torch.zeros(6, 4))
