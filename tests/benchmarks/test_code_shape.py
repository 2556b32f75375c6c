"""benchmarks.code_shape: long modules and functions are listed longest first, and the report exits 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import code_shape


def _made_up(tmp_path: Path) -> Path:
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    short = "\n".join(f"        y{i} = {i}" for i in range(10))
    longer = "\n".join(f"        z{i} = {i}" for i in range(80))
    path = tmp_path / "made_up.py"
    path.write_text(f'"""A made-up module."""\n\n\ndef long_one() -> None:\n{body}\n\n\n'
                    f"class Holder:\n    def short(self) -> None:\n{short}\n\n"
                    f"    def longer(self) -> None:\n{longer}\n")
    return path


def test_the_long_functions_of_a_made_up_file_are_found_longest_first(tmp_path: Path) -> None:
    path = _made_up(tmp_path)
    modules, functions = code_shape.shape([path], tmp_path)
    assert modules == []
    assert functions == [code_shape.Long("made_up.py:90", "Holder.longer", 81),
                         code_shape.Long("made_up.py:4", "long_one", 71)]
    modules, functions = code_shape.shape([path], tmp_path, module_lines=100, function_lines=75)
    assert modules == [code_shape.Long("made_up.py", "", 170)] and [f.name for f in functions] == ["Holder.longer"]


def test_the_report_lists_them_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert code_shape.main([str(_made_up(tmp_path))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "modules over 500 lines: 0" and lines[1] == "functions over 60 lines: 2"
    assert lines[2].endswith("made_up.py:90 Holder.longer") and lines[2].split()[0] == "81"
    assert lines[3].endswith("made_up.py:4 long_one") and lines[3].split()[0] == "71"
