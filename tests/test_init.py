"""Tests of the public API surface: every exported name resolves; importing stays torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

import duplexpipe


@pytest.mark.parametrize("name", duplexpipe.__all__)
def test_every_exported_name_resolves(name: str) -> None:
    assert getattr(duplexpipe, name) is not None


def test_unknown_attribute_raises() -> None:
    with pytest.raises(AttributeError, match="nosuch"):
        duplexpipe.nosuch  # noqa: B018


def test_import_and_schedule_tools_do_not_import_torch() -> None:
    code = ("import sys, duplexpipe; from duplexpipe.cli import main; "
            "main(['verify', 'dualpipe', '-p', '4', '-m', '8']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_the_old_home_reexports_the_same_objects() -> None:
    from duplexpipe.pipeline import Pipeline, PipelineConfig, make_mesh, run, split_model

    assert Pipeline is duplexpipe.Pipeline and PipelineConfig is duplexpipe.PipelineConfig
    assert run is duplexpipe.run and make_mesh is duplexpipe.make_mesh and split_model is duplexpipe.split_model
