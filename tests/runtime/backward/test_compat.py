"""The compat module: the torch versions its private names were written for, checked at import."""

from __future__ import annotations

import re

import pytest
import torch

from duplexpipe.runtime.backward import compat


def test_the_installed_torch_is_one_the_names_were_written_for() -> None:
    assert compat.version_problem(torch.__version__) is None


@pytest.mark.parametrize("version", ["2.13.0", "2.13.1+cpu", "2.13.0a0+git1234"])
def test_releases_inside_the_tested_range_pass(version: str) -> None:
    assert compat.version_problem(version) is None


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0", "3.0.0", "2.4.1+cu121"])
def test_a_torch_outside_the_tested_range_is_named_in_a_warning(version: str) -> None:
    problem = compat.version_problem(version)
    assert problem is not None and f"torch {version} is installed" in problem
    assert f"written for torch {compat.WRITTEN_FOR}" in problem and ">=2.13,<2.14" in problem
    with pytest.warns(UserWarning, match=re.escape(f"torch {version} is installed")):
        compat.check_torch_version(version)


def test_an_unreadable_version_is_named() -> None:
    problem = compat.version_problem("nightly")
    assert problem is not None and "'nightly'" in problem


def test_the_tested_range_is_the_one_pyproject_declares() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    (low, high) = compat.TESTED
    assert f'"torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}"' in text
