"""Options written as text: `name` or `name(key=value, ...)`, one or a comma-separated pair, parsed without
running any code (the command line's and the config file's form of an options object)."""

from __future__ import annotations

import ast
from typing import Any

Label = tuple[str, dict[str, Any]]
"""A parsed label: (name, keyword options)."""
MAX_LABEL_CHARS = 1000
"""Longest label text parsed (a label is a few words; anything longer is refused before parsing)."""


def _chain(node: ast.expr) -> list[ast.expr]:
    """The parts of `a/b/c` in order (a single part for anything else)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _chain(node.left) + _chain(node.right)
    return [node]


def _value(node: ast.expr, text: str) -> Any:
    """A keyword's value: a literal (number, string, True/False/None), a bare word taken as text (true/false as
    booleans, none as None), or a `/`-separated run of words and labels taken as text ("none/bf16/int8(block=128)",
    a ladder)."""
    if isinstance(node, ast.Name):
        return {"true": True, "false": False, "none": None}.get(node.id.lower(), node.id)
    parts = _chain(node)
    if len(parts) > 1:
        for part in parts:
            _one(part, text)  # each part must be NAME or NAME(key=value, ...)
        return "/".join(ast.unparse(part) for part in parts)
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"bad options {text!r}: a value must be a number, a word or a quoted string") from None


def _one(node: ast.expr, text: str) -> Label:
    if isinstance(node, ast.Name):
        return node.id, {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args \
            and all(k.arg is not None for k in node.keywords):
        return node.func.id, {str(k.arg): _value(k.value, text) for k in node.keywords}
    raise ValueError(f"bad options {text!r}: expected NAME or NAME(key=value, ...), e.g. int8(block=128)")


def parse_labels(text: str) -> list[Label]:
    """`"fp8, int8(block=128)"` -> [("fp8", {}), ("int8", {"block": 128})]; one label gives a list of one.
    ValueError naming the text when it is not of that form (nothing is evaluated but literals)."""
    if len(text) > MAX_LABEL_CHARS:
        raise ValueError(f"options text of {len(text)} characters is over the limit of {MAX_LABEL_CHARS}")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"bad options {text!r}: expected NAME or NAME(key=value, ...), or two of them separated "
                         "by a comma") from None
    nodes = tree.elts if isinstance(tree, ast.Tuple) else [tree]
    return [_one(node, text) for node in nodes]


def parse_label(text: str) -> Label:
    """`"powersgd(rank=1)"` -> ("powersgd", {"rank": 1}); ValueError for a pair or anything else."""
    labels = parse_labels(text)
    if len(labels) != 1:
        raise ValueError(f"bad options {text!r}: expected one NAME or NAME(key=value, ...)")
    return labels[0]


def build_options(cls: Any, options: dict[str, Any], what: str) -> Any:
    """`cls(**options)`, with a ValueError naming `what` and the keys `cls` takes when a key is not one of them."""
    import dataclasses

    known = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else None
    unknown = sorted(set(options) - set(known)) if known is not None else []
    if unknown:
        raise ValueError(f"{what}: unknown option(s) {unknown}; it takes {', '.join(known or []) or 'none'}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"{what}: {exc}") from None
