"""Tests of the public API surface: every exported name resolves; importing stays torch-free."""

from __future__ import annotations

import importlib
import pkgutil
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


def test_the_old_home_is_gone() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("duplexpipe.pipeline")


def test_the_api_is_small_and_dir_shows_only_it() -> None:
    assert len(duplexpipe.__all__) <= 52 and len(set(duplexpipe.__all__)) == len(duplexpipe.__all__)
    shown = set(dir(duplexpipe))
    assert not {"Any", "importlib", "TYPE_CHECKING", "annotations", "MappingProxyType"} & shown
    assert {n for n in shown if not n.startswith("__")} == set(duplexpipe.__all__)
    assert not {"CharCorpus", "GPTConfig", "build_gpt", "gpt_task", "lm_loss", "gather_timeline",
                "LinkModel"} & shown, "the demo task's helpers live in duplexpipe.launch.tasks.gpt"


def test_every_public_name_comes_from_its_one_home() -> None:
    for name in duplexpipe.__all__:
        value = getattr(duplexpipe, name)
        home = getattr(value, "__module__", None)
        if isinstance(value, type) and issubclass(value, Exception):
            assert home == "duplexpipe.errors", name
        elif home is not None and name not in ("build_schedule", "schedule_names"):
            assert getattr(importlib.import_module(home), name) is value, name


def _exporters(name: str) -> list[str]:
    """The modules of duplexpipe that offer `name`: the one defining it, those listing it in `__all__`, and the
    package faces holding it."""
    found = []
    for info in pkgutil.walk_packages(duplexpipe.__path__, "duplexpipe."):
        if info.name.startswith(("duplexpipe.cli", "duplexpipe.viz")) or info.name == "duplexpipe.errors":
            continue
        module = importlib.import_module(info.name)
        value = vars(module).get(name)
        defines = value is not None and getattr(value, "__module__", info.name) == info.name and \
            "__all__" not in vars(module)
        if defines or name in getattr(module, "__all__", ()) or (info.ispkg and value is not None):
            found.append(info.name)
    return found


@pytest.mark.parametrize("name", ["NoCompression", "Bf16Options", "Fp16Options", "PowerSGDOptions", "Int8Options",
                                  "TopKOptions", "RandomKOptions", "ThresholdOptions", "DGCOptions",
                                  "compression_options"])
def test_compression_options_have_one_home(name: str) -> None:
    assert _exporters(name) == ["duplexpipe.dp_options.compression"]


def test_zero_options_have_one_home() -> None:
    assert _exporters("ZeroOptions") == ["duplexpipe.dp_options.zero"]
    assert not hasattr(importlib.import_module("duplexpipe.parallel.zero_config"), "ZeroOptions")
    assert duplexpipe.ZeroOptions.__module__ == "duplexpipe.dp_options.zero"
