"""docs/architecture.md describes the tree as it is: every module path it names exists, and its runtime table lists
every runtime module."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "duplexpipe"
TOKEN = re.compile(r"`([^`\s]+)`")
FILE = re.compile(r"^[\w./]*\w\.py$")
"""A file path: `runtime/executor.py`, `duplexpipe/errors.py`, `tests/test_layers.py`, or a bare `split.py`."""
FOLDER = re.compile(r"^(duplexpipe/)?[a-z_]+(/[a-z_]+)*/$|^duplexpipe(/[a-z_]+)+$")
"""A folder: `duplexpipe/runtime`, `parallel/`, `schedules/generators/`."""
DOTTED = re.compile(r"^duplexpipe(\.[A-Za-z_]\w*)+$")
"""A module or a name in one: `duplexpipe.dp_options.compression`, `duplexpipe.runtime.link_emulator.LinkModel`."""
"""The doc describes the tree after the three branches of issue 28 merge; i28-h1's modules are not on this one."""


def _sections() -> list[tuple[str, list[str]]]:
    """(heading, its backticked tokens) per section; the text before the first heading has heading ""."""
    out: list[tuple[str, list[str]]] = [("", [])]
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            out.append((line, []))
        out[-1][1].extend(TOKEN.findall(line))
    return out


def _folders(heading: str) -> list[Path]:
    """Where a bare file name in a section is looked for: the package folders its heading names."""
    found = [PACKAGE]
    for token in TOKEN.findall(heading):
        name = token.removeprefix("duplexpipe/").rstrip("/")
        if FILE.match(name):
            name = str(Path(name).parent)
        if (PACKAGE / name).is_dir():
            found.append(PACKAGE / name)
    return found


def _exists(token: str, folders: list[Path]) -> bool:
    if "/" in token:
        return (ROOT / token).exists() or (PACKAGE / token.removeprefix("duplexpipe/")).exists()
    return any((folder / token).exists() for folder in folders)


def _resolves(dotted: str) -> bool:
    """The longest importable module prefix of `dotted`, and the rest as attributes of it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(value, attr):
                return False
            value = getattr(value, attr)
        return True
    return False


def _missing() -> list[str]:
    missing = []
    for heading, tokens in _sections():
        folders = _folders(heading)
        for token in tokens:
            if (FILE.match(token) or FOLDER.match(token)) and not _exists(token, folders):
                missing.append(f"{token} (under {heading or 'the top'!r})")
            elif DOTTED.match(token) and not _resolves(token):
                missing.append(token)
    return sorted(set(missing))


def test_the_doc_names_paths_and_modules() -> None:
    tokens = [t for _, ts in _sections() for t in ts]
    assert sum(bool(FILE.match(t)) for t in tokens) > 50 and sum(bool(DOTTED.match(t)) for t in tokens) > 5


def test_every_module_path_named_in_the_doc_exists() -> None:
    missing = _missing()
    assert not missing, "docs/architecture.md names what does not exist: " + ", ".join(missing)


def test_the_runtime_table_lists_every_runtime_module() -> None:
    named = {t for _, ts in _sections() for t in ts if t.startswith("runtime/") and t.endswith(".py")}
    modules = {f"runtime/{p.name}" for p in (PACKAGE / "runtime").glob("*.py")}
    assert modules <= named, f"runtime modules missing from docs/architecture.md: {sorted(modules - named)}"


def test_the_check_sees_a_missing_module() -> None:
    assert _exists("runtime/executor.py", [PACKAGE]) and not _exists("runtime/options.py", [PACKAGE])
    assert _exists("executor.py", _folders("## Runtime (`duplexpipe/runtime`)"))
    assert not _exists("executor.py", _folders("## Drawing (`duplexpipe/viz`)"))
    assert _resolves("duplexpipe.dp_options.compression.TopKOptions") and not _resolves("duplexpipe.pipeline")
    assert not _resolves("duplexpipe.dp_options.compression.NoSuchOptions")
