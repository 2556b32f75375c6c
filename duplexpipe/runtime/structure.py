"""Tensor structures between stages: a tensor, or tuples/lists/dicts (str keys, nested) of tensors, on torch's pytree.

A structure is flattened into its leaves (tensors) and a `Form` (a pytree TreeSpec) that rebuilds it.
Every leaf has a path for error messages: `out`, `out[1]`, `out["mask"]`, `out[1]["mask"]`. Subclasses of
tuple, list and dict (a namedtuple, an OrderedDict) travel as the plain container. The calling convention
of a stage: a tuple/list is passed as positional arguments, a dict as keyword arguments, a tensor as one
argument; a module whose `WHOLE_MESSAGE` attribute is True takes the structure as one argument, as
`nn.Sequential` hands one layer's output to the next (the parts of `Pipeline.from_layers`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from duplexpipe.errors import StructureError

Form = pytree.TreeSpec
"""How to rebuild a structure from its leaves (its JSON text is announced between ranks)."""
TENSOR: Form = pytree.treespec_leaf()
"""The form of a single tensor."""
WHOLE_MESSAGE = "duplexpipe_whole_message"
"""A module with this attribute set to True is called with the message as one argument."""
_KINDS = (tuple, list, dict)


def _stop(value: Any) -> bool:
    """Where flattening stops: at anything but a plain tuple, list or dict with str keys."""
    kind = type(value)
    if kind is dict:
        return not all(isinstance(k, str) for k in value)
    return kind is not tuple and kind is not list


def _path(root: str, keys: Sequence[Any]) -> str:
    """`root[1]["mask"]` for the pytree key entries of a leaf."""
    parts = [f'["{k.key}"]' if isinstance(k, pytree.MappingKey) else f"[{k.idx}]" for k in keys]
    return root + "".join(parts)


def paths(form: Form, root: str) -> list[str]:
    """Every leaf's path below `root`, in leaf order."""
    pairs, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(form.num_leaves)), form), is_leaf=_stop)
    return [_path(root, keys) for keys, _ in pairs]


def describe(form: Form) -> str:
    """`a tensor`, `a tuple of 2 tensors`, `a dict of 2 tensors ("h", "mask")`, or the leaves' paths when nested."""
    if form.is_leaf():
        return "a tensor"
    count = f"a {form.type.__name__} of {form.num_leaves} tensor{'s' if form.num_leaves != 1 else ''}"
    if any(not child.is_leaf() for child in form.children()):
        return f"{count} at {', '.join(paths(form, ''))}"
    return count + (" (" + ", ".join(f'"{k}"' for k in form.context) + ")" if form.type is dict else "")


def form_to_json(form: Form) -> str:
    """The form as JSON text (announced between ranks)."""
    return pytree.treespec_dumps(form)


def form_from_json(text: str) -> Form:
    """Inverse of `form_to_json`; StructureError unless it describes tuples/lists/dicts with str keys."""
    try:
        form = pytree.treespec_loads(text)
    except (ValueError, NotImplementedError, TypeError, KeyError) as exc:
        raise StructureError(f"cannot read the structure {text[:80]!r}: {exc}") from None
    if pytree.tree_flatten(pytree.tree_unflatten(list(range(form.num_leaves)), form), is_leaf=_stop)[1] != form:
        raise StructureError(f"the structure {text[:80]!r} holds more than tuples, lists and dicts with str keys")
    return form


def _plain(value: Any) -> Any:
    """A tuple, list or dict (a namedtuple, an OrderedDict...) as the plain container."""
    return tuple(value) if isinstance(value, tuple) else list(value) if isinstance(value, list) else dict(value)


def _checked(value: Any, root: str) -> tuple[Form, list[Tensor]]:
    """The slow path of `flatten`: plain containers for subclasses, then the path of the first bad leaf."""
    pairs, form = pytree.tree_flatten_with_path(value, is_leaf=_stop)
    for keys, leaf in pairs:
        path = _path(root, keys)
        if isinstance(leaf, dict) and not all(isinstance(k, str) for k in leaf):
            bad = next(k for k in leaf if not isinstance(k, str))
            raise StructureError(f"{path} is a dict with a non-str key {bad!r}; keys must be str")
        if not isinstance(leaf, Tensor) and not isinstance(leaf, _KINDS) and not keys:
            raise StructureError(f"{root} is {type(leaf).__name__}; expected a tensor, or tuples/lists/dicts "
                                 "(str keys) of tensors")
        if not isinstance(leaf, (Tensor, *_KINDS)):
            kind = "None" if leaf is None else type(leaf).__name__
            raise StructureError(f"{path} is {kind}, not a tensor (every element of a structure between "
                                 "stages must be a tensor)")
    if any(isinstance(leaf, _KINDS) for _, leaf in pairs):  # a namedtuple, an OrderedDict...: made plain
        return flatten(pytree.tree_unflatten([_plain(v) if isinstance(v, _KINDS) else v for _, v in pairs],
                                             form), root)
    empty = f"{root} is an empty {type(value).__name__}" if not len(value) else f"{root} holds no tensor"
    raise StructureError(f"{empty}; at least one tensor must flow")


def flatten(value: Any, root: str) -> tuple[Form, list[Tensor]]:
    """(form, leaves) of a structure; StructureError naming the path of the first leaf that is not a tensor."""
    if isinstance(value, Tensor):
        return TENSOR, [value]
    leaves, form = pytree.tree_flatten(value, is_leaf=_stop)
    if leaves and all(isinstance(t, Tensor) for t in leaves):
        return form, leaves
    return _checked(value, root)


def unflatten(form: Form, leaves: Sequence[Tensor]) -> Any:
    """The structure `form` describes, holding `leaves`."""
    return leaves[0] if form.is_leaf() else pytree.tree_unflatten(leaves, form)


def _misfit(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """'' when `fn` accepts these arguments, else `Block.forward(x)` and why not."""
    module = isinstance(fn, torch.nn.Module)
    try:
        signature = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
    except (TypeError, ValueError):  # no signature to check (a builtin)
        return ""
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        name = f"{type(fn).__name__}.forward" if module else getattr(fn, "__name__", "fn")
        return f"{name}{signature.replace(return_annotation=inspect.Signature.empty)} does not take them ({exc})"
    return ""


def call(fn: Callable[..., Any], form: Form, leaves: Sequence[Tensor], who: str = "") -> Any:
    """fn(*leaves) for a tuple/list, fn(**dict) for a dict, fn(tensor) for a tensor, fn(structure) when
    fn's WHOLE_MESSAGE is True. A TypeError because the arguments do not fit fn's signature names `who`,
    the structure and the signature."""
    value = unflatten(form, leaves)
    args: tuple[Any, ...]
    if form.is_leaf() or getattr(fn, WHOLE_MESSAGE, False):
        args, kwargs, passed = (value,), {}, "one argument"
    elif form.type is dict:
        args, kwargs, passed = (), value, "keyword arguments"
    else:
        args, kwargs, passed = tuple(value), {}, f"{len(value)} positional arguments"
    try:
        return fn(*args, **kwargs)
    except TypeError as exc:
        problem = _misfit(fn, args, kwargs)
        if not problem:
            raise
        raise TypeError(f"{who or 'the module'}: its input is {describe(form)}, passed as {passed}, but {problem}. "
                        "Pipeline(parts) passes a tuple/list as positional arguments and a dict as keyword "
                        "arguments; the parts of Pipeline.from_layers take it whole, as nn.Sequential does"
                        ) from exc


def split(value: Any, num_microbatches: int, what: str) -> list[Any]:
    """Split every leaf along dim 0 into M microbatches (sizes differ by at most one).

    Raises ValueError naming the path when a leaf is not a tensor with a batch dimension, has
    fewer rows than microbatches, or disagrees with the first leaf's row count.
    """
    form, leaves = flatten(value, what)
    rows = leaves[0].shape[0] if leaves[0].dim() else -1
    for index, leaf in enumerate(leaves):
        if leaf.dim() == 0 or leaf.shape[0] != rows:
            named = paths(form, what)  # only for the error
            if leaf.dim() == 0:
                raise ValueError(f"{named[index]} must be a tensor with the batch along dim 0, got a 0-d tensor")
            raise ValueError(f"{named[index]} has {leaf.shape[0]} rows but {named[0]} has {rows}; every "
                             "leaf must hold the same batch rows")
    if rows < num_microbatches:
        noun = what if form.is_leaf() else f"{what} leaves"
        raise ValueError(f"{noun} have {rows} rows, fewer than the {num_microbatches} microbatches of the "
                         "schedule (every microbatch needs at least one row)")
    pieces = [torch.tensor_split(leaf, num_microbatches, dim=0) for leaf in leaves]
    return [unflatten(form, [p[m] for p in pieces]) for m in range(num_microbatches)]


def rows(value: Any) -> int:
    """The batch rows of a (valid) structure: dim 0 of its first leaf."""
    return int(flatten(value, "value")[1][0].shape[0])


def signature(value: Any) -> list[Any]:
    """Form (JSON text), shapes and dtypes of a structure (JSON-ready; equal for equally shaped structures)."""
    form, leaves = flatten(value, "value")
    return [form_to_json(form), [(tuple(t.shape), str(t.dtype)) for t in leaves]]


def describe_signature(found: list[Any]) -> str:
    """`shape (8, 3) and dtype torch.int64` for a tensor's `signature`, else the structure, shapes and dtypes."""
    form, leaves = form_from_json(found[0]), found[1]
    if form.is_leaf():
        return f"shape {leaves[0][0]} and dtype {leaves[0][1]}"
    return f"{describe(form)} of shapes and dtypes {leaves}"


def concat(parts: Sequence[Any]) -> Any:
    """The structures `parts` (all of one form) concatenated leaf by leaf along dim 0."""
    form, _ = flatten(parts[0], "output")
    columns = [flatten(p, "output")[1] for p in parts]
    return unflatten(form, [torch.cat([c[i] for c in columns], dim=0) for i in range(form.num_leaves)])


def map_leaves(fn: Callable[[Tensor], Tensor], value: Any) -> Any:
    """The structure with `fn` applied to every leaf."""
    form, leaves = flatten(value, "value")
    return unflatten(form, [fn(t) for t in leaves])
