"""The package layering: no circle of files, no import from a lower package up to a higher one, and the
torch-free packages (schedules, dp_options, config, planner) import no torch at module level."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "duplexpipe"

LEVELS = {
    "schedules": 0, "dp_options": 0, "comm": 1, "config": 2, "planner": 3, "runtime": 3, "tp": 4, "viz": 4, "moe": 5,
    "model": 6, "parallel": 7, "train": 8, "launch": 9, "cli": 10,
}
"""A package may import its own modules and those of packages on lower levels only (docs/architecture.md)."""
FACES = ("duplexpipe/__init__.py",)
"""The public face: it re-exports from every package and nothing inside imports it."""
TORCH_FREE = ("schedules", "dp_options", "config", "planner")


@functools.cache
def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, *, top_level_only: bool = False, type_hints: bool = False) -> list[str]:
    """Modules `path` imports (absolute names; imports under `if TYPE_CHECKING:` left out unless `type_hints`).
    `from pkg import name` names `pkg.name` when that is a module (the package's own __init__ is then not
    counted), else `pkg`."""
    modules = _modules()
    found: list[str] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child) and not type_hints:
                continue
            if isinstance(child, ast.Import):
                found.extend(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    found.append(sub if sub in modules else child.module)
            is_scope = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if not (top_level_only and is_scope):
                visit(child, top and not is_scope)

    visit(ast.parse(path.read_text()), True)
    return found


def _graph(type_hints: bool = False) -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target in _imports(path, type_hints=type_hints):
            if target in modules and target != name:
                graph.add_edge(name, target)
    return graph


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LEVELS) else None


def test_every_package_has_a_level() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LEVELS), f"packages without a level in LEVELS: {sorted(packages - set(LEVELS))}"


def _circles(type_hints: bool) -> list[list[str]]:
    """Every circle of files (a strongly connected set of two or more), each as its sorted paths."""
    modules = _modules()
    return [sorted(str(modules[m].relative_to(ROOT)) for m in c)
            for c in nx.strongly_connected_components(_graph(type_hints)) if len(c) > 1]


def test_no_circle_of_files() -> None:
    circles = _circles(type_hints=False)
    assert not circles, "files that import each other in a circle: " + "; ".join(" <-> ".join(c) for c in circles)


HINT_CIRCLES_BEING_BROKEN: list[list[str]] = []
"""Circles through `if TYPE_CHECKING:` imports still allowed while one is being broken (none now: the checkpoint
package reads the Pipeline through its own Protocol)."""


def test_no_circle_of_files_counting_type_hint_imports() -> None:
    circles = [c for c in _circles(type_hints=True) if c not in HINT_CIRCLES_BEING_BROKEN]
    assert not circles, ("files that import each other in a circle (counting imports under TYPE_CHECKING): "
                         + "; ".join(" <-> ".join(c) for c in circles))


def test_imports_point_down_only() -> None:
    modules = _modules()
    upward = []
    for source, target in _graph().edges:
        src_pkg, dst_pkg = _package(source), _package(target)
        if str(modules[target].relative_to(ROOT)) in FACES and str(modules[source].relative_to(ROOT)) not in FACES:
            upward.append(f"{modules[source].relative_to(ROOT)} -> {modules[target].relative_to(ROOT)} (a face)")
        if src_pkg is None or dst_pkg is None or src_pkg == dst_pkg:
            continue
        if LEVELS[dst_pkg] >= LEVELS[src_pkg]:
            upward.append(f"{modules[source].relative_to(ROOT)} ({src_pkg}) -> {modules[target].relative_to(ROOT)} "
                          f"({dst_pkg})")
    assert not upward, "imports that do not point down:\n" + "\n".join(sorted(set(upward)))


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_packages_import_no_torch_at_module_level(package: str) -> None:
    modules = {n: p for n, p in _modules().items() if n.split(".")[1:2] == [package]}
    # what each module imports at module level, followed through the package's own modules
    reach = {n: [t for t in _imports(p, top_level_only=True)] for n, p in _modules().items()}
    offenders = []
    for name in modules:
        seen, todo = {name}, [name]
        while todo:
            for target in reach.get(todo.pop(), []):
                if target.split(".")[0] == "torch":
                    offenders.append(f"{modules[name].relative_to(ROOT)} reaches torch ({target})")
                    todo.clear()
                    break
                if target in reach and target not in seen:
                    seen.add(target)
                    todo.append(target)
    assert not offenders, "\n".join(sorted(set(offenders)))
    names = " ".join(f"import {n};" for n in sorted(modules))
    code = f"import sys; {names} print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


PLANNING = ("duplexpipe.train.planning", "duplexpipe.train.planning.auto", "duplexpipe.train.planning.calibration",
            "duplexpipe.train.planning.choice", "duplexpipe.train.planning.measure_cache",
            "duplexpipe.train.planning.measure")
"""The planning step before a Pipeline is built, and the measuring it does."""


@pytest.mark.parametrize("config", ["duplexpipe.config.pipeline", "duplexpipe.train.pipeline_config"])
def test_the_config_imports_nothing_of_the_planner_or_of_measuring(config: str) -> None:
    graph = _graph()
    direct = sorted(t for t in graph.successors(config) if t.startswith("duplexpipe.planner") or t in PLANNING)
    assert not direct, f"{config} imports {direct}"
    reached = sorted(t for t in nx.descendants(graph, config) if t in PLANNING or t == "duplexpipe.planner.plan")
    assert not reached, f"{config} reaches {reached}"


def test_the_planning_step_sits_below_the_trainer() -> None:
    graph = _graph(type_hints=True)
    for module in PLANNING:
        assert "duplexpipe.train.trainer" not in nx.descendants(graph, module), f"{module} reaches the trainer"


def test_a_pipeline_builds_no_pipeline_and_plans_nothing() -> None:
    """Pipeline.__init__ builds only: planning is a step before it (train/planning/, below it; from_layers and
    from_pretrained call it), and it calls no Pipeline constructor itself."""
    tree = ast.parse((PACKAGE / "train" / "trainer.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pipeline")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    calls = {ast.unparse(n.func) for n in ast.walk(init) if isinstance(n, ast.Call)}
    assert not calls & {"plan_pipeline", "choose", "measure", "profile_parts", "calibrate"}, sorted(calls)
    assert not calls & {"Pipeline", "cls", "type(self)", "self.__class__"}, sorted(calls)
