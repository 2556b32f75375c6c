"""Tensor structures: flatten/unflatten, paths, the calling convention, splitting and concatenation."""

from __future__ import annotations

import pytest
import torch

from duplexpipe.runtime.structure import (
    TENSOR,
    Form,
    StructureError,
    call,
    concat,
    flatten,
    map_leaves,
    rows,
    signature,
    split,
    unflatten,
)


@pytest.mark.parametrize("value", [torch.zeros(2), (torch.zeros(2), torch.ones(2)), [torch.zeros(2)],
                                   {"h": torch.zeros(2), "mask": torch.ones(2, dtype=torch.bool)}])
def test_flatten_then_unflatten_rebuilds_the_structure(value: object) -> None:
    form, leaves = flatten(value, "out")
    back = unflatten(form, leaves)
    assert type(back) is type(value)
    assert Form.from_json(form.to_json()) == form
    again_form, again = flatten(back, "out")
    assert again_form == form and all(a is b for a, b in zip(again, leaves, strict=True))


def test_paths_name_each_leaf() -> None:
    assert TENSOR.paths("out") == ["out"]
    assert Form("tuple", ("", "")).paths("out") == ["out[0]", "out[1]"]
    assert Form("dict", ("h", "mask")).paths("out") == ['out["h"]', 'out["mask"]']


@pytest.mark.parametrize("value, message", [
    ((torch.zeros(1), None), r"out\[1\] is None, not a tensor"),
    ({"h": torch.zeros(1), "mask": 3}, r'out\["mask"\] is int, not a tensor'),
    ({1: torch.zeros(1)}, "non-str key 1"),
    ((), "out is an empty tuple"),
    ("text", "out is str; expected a tensor"),
    ((torch.zeros(1), (torch.zeros(1),)), r"out\[1\] is tuple, not a tensor"),
])
def test_non_tensors_are_named_by_path(value: object, message: str) -> None:
    with pytest.raises(StructureError, match=message):
        flatten(value, "out")


def test_calling_convention_positional_keyword_single() -> None:
    def fn(*args: object, **kwargs: object) -> tuple[object, object]:
        return args, kwargs

    a, b = torch.zeros(1), torch.ones(1)
    assert call(fn, TENSOR, [a]) == ((a,), {})
    assert call(fn, Form("list", ("", "")), [a, b]) == ((a, b), {})
    assert call(fn, Form("dict", ("x", "y")), [a, b]) == ((), {"x": a, "y": b})


def test_split_concat_and_rows() -> None:
    value = {"x": torch.arange(10.0).view(5, 2), "ids": torch.arange(5)}
    parts = split(value, 3, "inputs")
    assert [rows(p) for p in parts] == [2, 2, 1]
    whole = concat(parts)
    assert torch.equal(whole["x"], value["x"]) and torch.equal(whole["ids"], value["ids"])
    with pytest.raises(ValueError, match="inputs leaves have 5 rows, fewer than the 6 microbatches"):
        split(value, 6, "inputs")


def test_signature_and_map_leaves() -> None:
    pair = (torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64))
    assert signature(pair) == [["tuple", ["", ""]], [((2, 3), "torch.float32"), ((2,), "torch.int64")]]
    doubled = map_leaves(lambda t: t + 1, pair)
    assert isinstance(doubled, tuple) and torch.equal(doubled[0], torch.ones(2, 3))
