"""duplexpipe.errors: every exception class is defined there and imported from there, torch-free, with the
class hierarchy callers rely on."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from duplexpipe import errors

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "duplexpipe"
FACES = ("duplexpipe/__init__.py", "duplexpipe/pipeline.py")
"""The public faces re-export the public exceptions (tests/test_init.py checks that they resolve)."""
CLI_INTERNAL = {("duplexpipe/cli/args.py", "CliError")}
"""The command line's own error: never raised to a library user."""
BUILTIN_BASES = {"Exception", "BaseException", "ValueError", "RuntimeError", "TypeError", "TimeoutError",
                 "FloatingPointError", "KeyError", "OSError", "LookupError", "ArithmeticError"}
NAMES = set(errors.__all__)


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def test_errors_lists_exactly_its_exception_classes() -> None:
    defined = {n for n in vars(errors) if isinstance(getattr(errors, n), type)
               and issubclass(getattr(errors, n), BaseException)}
    assert defined == NAMES


def test_no_other_module_defines_an_exception_class() -> None:
    found = []
    for name, tree in _modules():
        if name == "duplexpipe/errors.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (name, node.name) not in CLI_INTERNAL:
                bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
                if bases & (BUILTIN_BASES | NAMES):
                    found.append(f"{name}:{node.lineno} {node.name}")
    assert not found, "exception classes outside duplexpipe/errors.py: " + ", ".join(found)


def test_every_module_imports_exceptions_from_errors() -> None:
    found = []
    for name, tree in _modules():
        if name in FACES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "duplexpipe.errors":
                found += [f"{name}:{node.lineno} {a.name} from {node.module}" for a in node.names if a.name in NAMES]
    assert not found, "exceptions imported from an old home: " + ", ".join(found)


def test_importing_errors_loads_no_torch() -> None:
    code = "import sys, duplexpipe.errors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("cls, bases", [
    (errors.ScheduleError, (ValueError,)),
    (errors.PlanError, (ValueError,)),
    (errors.ProfileError, (ValueError,)),
    (errors.StructureError, (ValueError,)),
    (errors.InputRejected, (ValueError,)),
    (errors.NonFiniteSendError, (FloatingPointError,)),
    (errors.PipelineError, (RuntimeError,)),
    (errors.PipelineTimeoutError, (errors.PipelineError, TimeoutError)),
    (errors.PeerFailedError, (errors.PipelineError,)),
    (errors.HandshakeError, (errors.PipelineError,)),
    (errors.ActivationShapeError, (errors.PipelineError, ValueError)),
    (errors.PairAborted, (RuntimeError,)),
    (errors.LaunchError, (RuntimeError,)),
    (errors.StoppedByPeer, (RuntimeError,)),
])
def test_the_hierarchy_callers_catch_by(cls: type, bases: tuple[type, ...]) -> None:
    assert all(issubclass(cls, b) for b in bases)


def test_errors_with_fields_keep_them() -> None:
    peer = errors.PeerFailedError("rank 1: stopping because rank 0 failed", 0)
    assert peer.failed_rank == 0 and str(peer) == "rank 1: stopping because rank 0 failed"
    assert errors.PlanError("no plan", smallest_cap=2.0).smallest_cap == 2.0
    launch = errors.LaunchError("rank 2 failed\ntraceback", rank=2)
    assert (launch.rank, launch.summary, launch.errors) == (2, "rank 2 failed", {})
    stopped = errors.StoppedByPeer(1, 0, same_node=True)
    assert str(stopped) == "rank 1 stopped because rank 0 failed: see rank 0's error" and stopped.same_node
    assert pickle.loads(pickle.dumps(errors.ScheduleError("bad"))).args == ("bad",)
