"""Long modules and functions, longest first (`python -m benchmarks.code_shape [PATH ...]`): smells, not caps."""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES = 500
"""A module longer than this is listed: is it still one concept? (Split by meaning, never by size.)"""
FUNCTION_LINES = 60
"""A function longer than this is listed: does it do one thing?"""


@dataclass(frozen=True)
class Long:
    """One module or function over its line count."""

    where: str  # `path` for a module, `path:line` for a function
    name: str  # the function's qualified name; "" for a module
    lines: int


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function under `tree`: methods and nested functions too."""
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((prefix + node.name, node))
        scope = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        found.extend(_functions(node, f"{prefix}{getattr(node, 'name', '')}." if scope else prefix))
    return found


def _longest_first(item: Long) -> tuple[int, str]:
    return -item.lines, item.where


def shape(files: Sequence[Path], root: Path = ROOT, module_lines: int = MODULE_LINES,
          function_lines: int = FUNCTION_LINES) -> tuple[list[Long], list[Long]]:
    """(modules over `module_lines`, functions over `function_lines`) of `files`, each sorted longest first."""
    modules, functions = [], []
    for path in files:
        text = path.read_text(encoding="utf-8")
        shown = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        if (count := text.count("\n")) > module_lines:
            modules.append(Long(shown, "", count))
        for name, node in _functions(ast.parse(text)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > function_lines:
                functions.append(Long(f"{shown}:{node.lineno}", name, length))
    return sorted(modules, key=_longest_first), sorted(functions, key=_longest_first)


def report(modules: Sequence[Long], functions: Sequence[Long], module_lines: int = MODULE_LINES,
           function_lines: int = FUNCTION_LINES) -> list[str]:
    """The report's lines: the long modules, then the long functions."""
    lines = [f"modules over {module_lines} lines: {len(modules)}"]
    lines += [f"  {item.lines:5d}  {item.where}" for item in modules]
    lines.append(f"functions over {function_lines} lines: {len(functions)}")
    lines += [f"  {item.lines:5d}  {item.where} {item.name}" for item in functions]
    return lines


def _python_files(paths: Sequence[str]) -> list[Path]:
    found: set[Path] = set()
    for name in paths:
        path = Path(name).resolve()
        found.update(path.rglob("*.py") if path.is_dir() else [path])
    return sorted(found)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report (exit 0: the lengths are for a reader to judge)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("paths", nargs="*", default=[str(ROOT / "duplexpipe")], help="files or folders (default: "
                        "the duplexpipe package)")
    parser.add_argument("--module-lines", type=int, default=MODULE_LINES, help="list modules longer than this")
    parser.add_argument("--function-lines", type=int, default=FUNCTION_LINES, help="list functions longer than this")
    args = parser.parse_args(argv)
    modules, functions = shape(_python_files(args.paths), ROOT, args.module_lines, args.function_lines)
    print("\n".join(report(modules, functions, args.module_lines, args.function_lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
