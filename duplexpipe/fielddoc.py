"""Field docstrings made visible: the string under each dataclass field, read from the class source once,
appended to the class `__doc__` (so `help()` shows it) and handed to the command line's help."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from types import MappingProxyType
from typing import Any, TypeVar

T = TypeVar("T")


DOCS_ATTRIBUTE = "__field_docs__"
"""Where `documented` keeps a class's field docstrings, read once (the command line asks for them on every run)."""


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring, whitespace folded} for every annotated field of `cls` that has one (read from
    the class body's source, or kept by `documented`; {} when the source cannot be read)."""
    kept = cls.__dict__.get(DOCS_ATTRIBUTE)
    if kept is not None:
        return dict(kept)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = next((node.body for node in tree.body if isinstance(node, ast.ClassDef)), [])
    docs: dict[str, str] = {}
    for field, after in zip(body, body[1:], strict=False):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[field.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if isinstance(field.default_factory, type):
        return repr(field.default_factory())
    if field.default_factory is not dataclasses.MISSING:  # a function: named, not called (it may import much)
        return f"{getattr(field.default_factory, '__name__', 'factory')}()"
    return "required"


def documented(cls: T) -> T:
    """Class decorator (above @dataclass): add a "Fields" section to the class docstring listing every field
    with its default and its docstring, as `help(cls)` and the API docs show it."""
    docs = field_docs(cls)  # type: ignore[arg-type]
    setattr(cls, DOCS_ATTRIBUTE, MappingProxyType(docs))
    lines = []
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        lines.append(f"    {field.name} (default {_default(field)})")
        if field.name in docs:
            lines.extend(textwrap.wrap(docs[field.name], 100, initial_indent=" " * 8, subsequent_indent=" " * 8,
                                       break_on_hyphens=False, break_long_words=False))
    if lines:
        cls.__doc__ = f"{inspect.cleandoc(cls.__doc__ or '')}\n\nFields:\n" + "\n".join(lines)
    return cls
