"""Tensor structures: flatten/unflatten, paths, the calling convention, splitting and concatenation."""

from __future__ import annotations

import json
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
from torch import nn

from duplexpipe.errors import StructureError
from duplexpipe.runtime.structure import (
    TENSOR,
    WHOLE_MESSAGE,
    call,
    concat,
    describe,
    describe_signature,
    flatten,
    form_from_json,
    form_to_json,
    map_leaves,
    paths,
    rows,
    signature,
    split,
    unflatten,
)

Pair = namedtuple("Pair", "h mask")


def _form(value: Any) -> Any:
    return flatten(value, "out")[0]


@pytest.mark.parametrize("value", [torch.zeros(2), (torch.zeros(2), torch.ones(2)), [torch.zeros(2)],
                                   {"h": torch.zeros(2), "mask": torch.ones(2, dtype=torch.bool)},
                                   (torch.zeros(2), {"m": torch.ones(2), "p": [torch.ones(1), torch.ones(3)]})])
def test_flatten_then_unflatten_rebuilds_the_structure(value: object) -> None:
    form, leaves = flatten(value, "out")
    back = unflatten(form, leaves)
    assert type(back) is type(value)
    assert form_from_json(form_to_json(form)) == form
    json.loads(form_to_json(form))  # plain JSON text: announced between ranks
    again_form, again = flatten(back, "out")
    assert again_form == form and all(a is b for a, b in zip(again, leaves, strict=True))


def test_paths_name_each_leaf() -> None:
    x = torch.zeros(1)
    assert paths(TENSOR, "out") == ["out"]
    assert paths(_form((x, x)), "out") == ["out[0]", "out[1]"]
    assert paths(_form({"h": x, "mask": x}), "out") == ['out["h"]', 'out["mask"]']
    assert paths(_form((x, {"mask": x, "pos": [x]})), "out") == ["out[0]", 'out[1]["mask"]', 'out[1]["pos"][0]']


def test_describe_names_the_structure() -> None:
    x = torch.zeros(1)
    assert describe(TENSOR) == "a tensor"
    assert describe(_form((x, x))) == "a tuple of 2 tensors"
    assert describe(_form([x])) == "a list of 1 tensor"
    assert describe(_form({"h": x, "mask": x})) == 'a dict of 2 tensors ("h", "mask")'
    assert describe(_form((x, {"m": x}))) == 'a tuple of 2 tensors at [0], [1]["m"]'


@pytest.mark.parametrize("value, message", [
    ((torch.zeros(1), None), r"out\[1\] is None, not a tensor"),
    ({"h": torch.zeros(1), "mask": 3}, r'out\["mask"\] is int, not a tensor'),
    ({1: torch.zeros(1)}, "out is a dict with a non-str key 1; keys must be str"),
    ((), "out is an empty tuple"),
    ("text", "out is str; expected a tensor"),
    ((torch.zeros(1), (torch.zeros(1), "x")), r"out\[1\]\[1\] is str, not a tensor"),
    ((torch.zeros(1), {"a": {2: torch.zeros(1)}}), r'out\[1\]\["a"\] is a dict with a non-str key 2'),
    (((), []), "out holds no tensor; at least one tensor must flow"),
])
def test_non_tensors_are_named_by_path(value: object, message: str) -> None:
    with pytest.raises(StructureError, match=message):
        flatten(value, "out")


def test_subclasses_travel_as_the_plain_container() -> None:
    x, m = torch.zeros(1), torch.ones(1)
    form, leaves = flatten(Pair(x, OrderedDict(m=m)), "out")
    assert form == _form((x, {"m": m})) and leaves[0] is x and leaves[1] is m
    assert form_from_json(form_to_json(form)) == form


def test_forms_from_json_hold_only_tuples_lists_and_dicts() -> None:
    bad = form_to_json(flatten(torch.zeros(1), "x")[0]).replace("null", '"collections.OrderedDict"', 1)
    with pytest.raises(StructureError, match="cannot read the structure|holds more than"):
        form_from_json(bad)


def test_calling_convention_positional_keyword_single() -> None:
    def fn(*args: object, **kwargs: object) -> tuple[object, object]:
        return args, kwargs

    a, b = torch.zeros(1), torch.ones(1)
    assert call(fn, TENSOR, [a]) == ((a,), {})
    assert call(fn, _form([a, b]), [a, b]) == ((a, b), {})
    assert call(fn, _form({"x": a, "y": b}), [a, b]) == ((), {"x": a, "y": b})
    nested = call(fn, _form((a, {"m": b})), [a, b])
    assert nested[0][0] is a and nested[0][1] == {"m": b}


def test_a_whole_message_module_takes_the_structure_as_one_argument() -> None:
    def fn(*args: object, **kwargs: object) -> tuple[object, object]:
        return args, kwargs

    setattr(fn, WHOLE_MESSAGE, True)
    a, b = torch.zeros(1), torch.ones(1)
    assert call(fn, _form((a, b)), [a, b]) == (((a, b),), {})
    assert call(fn, _form([a]), [a]) == (([a],), {})  # a 1-list stays a list
    assert call(fn, _form({"x": a}), [a]) == (({"x": a},), {})


class _OneArg(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Broken(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise TypeError("inside forward")


def test_arity_errors_name_the_caller_the_structure_and_the_signature() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    with pytest.raises(TypeError, match=r"stage 1 \(model part 1\): its input is a tuple of 2 tensors, passed as "
                                        r"2 positional arguments, but _OneArg.forward\(x: 'torch.Tensor'\) "
                                        r"does not take them \(too many positional arguments\)"):
        call(_OneArg(), _form((a, b)), [a, b], "stage 1 (model part 1)")
    with pytest.raises(TypeError, match=r'its input is a dict of 1 tensor \("z"\), passed as keyword arguments'):
        call(_OneArg(), _form({"z": a}), [a])
    with pytest.raises(TypeError, match="^inside forward$"):  # a TypeError of the forward itself is kept
        call(_Broken(), _form((a, b)), [a, b])


def test_split_concat_and_rows() -> None:
    value = {"x": torch.arange(10.0).view(5, 2), "ids": torch.arange(5)}
    parts = split(value, 3, "inputs")
    assert [rows(p) for p in parts] == [2, 2, 1]
    whole = concat(parts)
    assert torch.equal(whole["x"], value["x"]) and torch.equal(whole["ids"], value["ids"])
    with pytest.raises(ValueError, match="inputs leaves have 5 rows, fewer than the 6 microbatches"):
        split(value, 6, "inputs")
    with pytest.raises(ValueError, match=r'inputs\[1\]\["m"\] has 4 rows but inputs\[0\] has 5'):
        split((value["x"], {"m": torch.zeros(4)}), 2, "inputs")
    with pytest.raises(ValueError, match=r"inputs must be a tensor with the batch along dim 0, got a 0-d"):
        split(torch.tensor(1.0), 2, "inputs")


def test_signature_and_map_leaves() -> None:
    pair = (torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64))
    found = signature(pair)
    assert found[1] == [((2, 3), "torch.float32"), ((2,), "torch.int64")]
    assert form_from_json(found[0]) == _form(pair)
    json.dumps(found)  # JSON-ready
    assert signature((torch.ones(2, 3), torch.ones(2, dtype=torch.int64))) == found  # equal shapes: equal
    assert signature([*pair]) != found and signature((pair[0], pair[1].int())) != found
    assert signature({"a": pair[0], "b": pair[1]}) != signature({"a": pair[0], "c": pair[1]})
    assert describe_signature(signature(pair[1])) == "shape (2,) and dtype torch.int64"
    assert describe_signature(found).startswith("a tuple of 2 tensors of shapes and dtypes [((2, 3)")
    doubled = map_leaves(lambda t: t + 1, pair)
    assert isinstance(doubled, tuple) and torch.equal(doubled[0], torch.ones(2, 3))
