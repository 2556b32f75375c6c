"""Tensor structures between stages: a tensor, a tuple/list of tensors or a flat dict with str keys.

A structure is flattened into its leaves (a list of tensors) and a `Form` that rebuilds it.
Every leaf has a path for error messages: `out`, `out[1]`, `out["mask"]`. The calling
convention of a stage: a tuple/list is passed as positional arguments, a dict as keyword
arguments, a tensor as one argument.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

KINDS = ("tensor", "tuple", "list", "dict")


class StructureError(ValueError):
    """A value is not a tensor, a tuple/list of tensors or a flat dict of tensors with str keys."""


@dataclass(frozen=True)
class Form:
    """How to rebuild a structure from its leaves."""

    kind: str
    """"tensor", "tuple", "list" or "dict"."""
    keys: tuple[str, ...] = ()
    """dict: the keys in order; tuple/list: one empty string per element."""

    @property
    def size(self) -> int:
        """How many leaves the structure holds."""
        return 1 if self.kind == "tensor" else len(self.keys)

    def path(self, index: int, root: str) -> str:
        """The path of leaf `index` below `root`: `root`, `root[1]` or `root["mask"]`."""
        if self.kind == "tensor":
            return root
        if self.kind == "dict":
            return f'{root}["{self.keys[index]}"]'
        return f"{root}[{index}]"

    def paths(self, root: str) -> list[str]:
        """Every leaf's path, in leaf order."""
        return [self.path(i, root) for i in range(self.size)]

    def to_json(self) -> list[Any]:
        """A JSON-ready form."""
        return [self.kind, list(self.keys)]

    @staticmethod
    def from_json(data: Any) -> Form:
        """Inverse of `to_json`."""
        kind, keys = data
        if kind not in KINDS:
            raise StructureError(f"unknown structure kind {kind!r}; expected one of {KINDS}")
        return Form(str(kind), tuple(str(k) for k in keys))


TENSOR = Form("tensor")
"""The form of a single tensor."""


def _form_of(value: Any, root: str) -> tuple[Form, list[Any]]:
    if isinstance(value, Tensor):
        return TENSOR, [value]
    if isinstance(value, (tuple, list)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return Form(kind, ("",) * len(value)), list(value)
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise StructureError(f"{root} is a dict with a non-str key {bad[0]!r}; keys must be str")
        return Form("dict", tuple(value)), list(value.values())
    raise StructureError(f"{root} is {type(value).__name__}; expected a tensor, a tuple/list of tensors "
                         "or a flat dict of tensors with str keys")


def flatten(value: Any, root: str) -> tuple[Form, list[Tensor]]:
    """(form, leaves) of a structure; StructureError naming the path of the first non-tensor leaf."""
    form, leaves = _form_of(value, root)
    if form.kind != "tensor" and not leaves:
        raise StructureError(f"{root} is an empty {form.kind}; at least one tensor must flow")
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor):
            kind = "None" if leaf is None else type(leaf).__name__
            raise StructureError(f"{form.path(index, root)} is {kind}, not a tensor (every element of a "
                                 "structure between stages must be a tensor)")
    return form, leaves


def unflatten(form: Form, leaves: Sequence[Tensor]) -> Any:
    """The structure `form` describes, holding `leaves`."""
    if form.kind == "tensor":
        return leaves[0]
    if form.kind == "dict":
        return dict(zip(form.keys, leaves, strict=True))
    return tuple(leaves) if form.kind == "tuple" else list(leaves)


def call(fn: Callable[..., Any], form: Form, leaves: Sequence[Tensor]) -> Any:
    """fn(*leaves) for a tuple/list, fn(**dict) for a dict, fn(tensor) for a tensor."""
    if form.kind == "tensor":
        return fn(leaves[0])
    if form.kind == "dict":
        return fn(**dict(zip(form.keys, leaves, strict=True)))
    return fn(*leaves)


def split(value: Any, num_microbatches: int, what: str) -> list[Any]:
    """Split every leaf along dim 0 into M microbatches (sizes differ by at most one).

    Raises ValueError naming the path when a leaf is not a tensor with a batch dimension, has
    fewer rows than microbatches, or disagrees with the first leaf's row count.
    """
    form, leaves = flatten(value, what)
    rows = -1
    for index, leaf in enumerate(leaves):
        path = form.path(index, what)
        if leaf.dim() == 0:
            raise ValueError(f"{path} must be a tensor with the batch along dim 0, got a 0-d tensor")
        if rows < 0:
            rows = leaf.shape[0]
        elif leaf.shape[0] != rows:
            raise ValueError(f"{path} has {leaf.shape[0]} rows but {form.path(0, what)} has {rows}; every "
                             "leaf must hold the same batch rows")
    if rows < num_microbatches:
        noun = what if form.kind == "tensor" else f"{what} leaves"
        raise ValueError(f"{noun} have {rows} rows, fewer than the {num_microbatches} microbatches of the "
                         "schedule (every microbatch needs at least one row)")
    pieces = [torch.tensor_split(leaf, num_microbatches, dim=0) for leaf in leaves]
    return [unflatten(form, [p[m] for p in pieces]) for m in range(num_microbatches)]


def rows(value: Any) -> int:
    """The batch rows of a (valid) structure: dim 0 of its first leaf."""
    return int(flatten(value, "value")[1][0].shape[0])


def signature(value: Any) -> list[Any]:
    """Form, shapes and dtypes of a structure (JSON-ready; equal for equally shaped structures)."""
    form, leaves = flatten(value, "value")
    return [form.to_json(), [(tuple(t.shape), str(t.dtype)) for t in leaves]]


def concat(parts: Sequence[Any]) -> Any:
    """The structures `parts` (all of one form) concatenated leaf by leaf along dim 0."""
    form, _ = flatten(parts[0], "output")
    columns = [flatten(p, "output")[1] for p in parts]
    return unflatten(form, [torch.cat([c[i] for c in columns], dim=0) for i in range(form.size)])


def map_leaves(fn: Callable[[Tensor], Tensor], value: Any) -> Any:
    """The structure with `fn` applied to every leaf."""
    form, leaves = flatten(value, "value")
    return unflatten(form, [fn(t) for t in leaves])
