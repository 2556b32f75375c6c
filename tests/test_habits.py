"""The code's habits (docs/architecture.md, "Habits"): a docstring per module, package __init__ files that only
re-export, and the public API's two lists agreeing. Lengths are a report (`python -m benchmarks.code_shape`), not a
test."""

from __future__ import annotations

import ast
from pathlib import Path

import duplexpipe

ROOT = Path(__file__).resolve().parents[1]
FACE_FUNCTIONS = {"__getattr__", "__dir__"}
"""What the top-level face defines to load the public API lazily."""


def _files() -> list[Path]:
    return sorted((ROOT / "duplexpipe").rglob("*.py"))


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_module_has_a_docstring() -> None:
    missing = [_name(p) for p in _files() if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not missing, "modules without a docstring: " + ", ".join(missing)


def test_package_init_files_only_reexport() -> None:
    defining = []
    for path in _files():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            defines = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if defines and not (path.parent.name == "duplexpipe" and node.name in FACE_FUNCTIONS):
                defining.append(f"{_name(path)}:{node.lineno} {node.name}")
    assert not defining, "package __init__ files must only re-export; these define code: " + ", ".join(defining)


def test_the_public_api_lists_agree() -> None:
    """The lazy table and the TYPE_CHECKING imports name the same objects from the same modules."""
    tree = ast.parse((ROOT / "duplexpipe" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    typed = {(alias.asname or alias.name): (node.module, alias.name)
             for node in ast.walk(block) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert typed == dict(duplexpipe._LAZY)
