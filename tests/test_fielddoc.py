"""Tests for duplexpipe.fielddoc: every field's docstring shows in help() of the configs and in
`duplexpipe train --help`, from the one docstring in the source."""

from __future__ import annotations

import dataclasses
import pydoc
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from duplexpipe.fielddoc import documented, field_docs
from duplexpipe.launch.train_config import CheckpointConfig, MetricsConfig, OptimizerConfig, TrainConfig
from duplexpipe.runtime.config import RuntimeConfig
from duplexpipe.train.pipeline_config import (
    DataParallelConfig,
    ObserveConfig,
    PipelineConfig,
    PrecisionConfig,
    SafetyConfig,
)


@documented
@dataclass
class _Example:
    """An example."""

    size: int = 3
    """How many,
    over two lines."""
    names: list[str] = field(default_factory=list)
    undocumented_after: str = "x"
    """The last one."""


def test_docstrings_under_fields_are_collected_and_listed_with_defaults() -> None:
    assert field_docs(_Example) == {"size": "How many, over two lines.", "undocumented_after": "The last one."}
    doc = _Example.__doc__ or ""
    assert doc.startswith("An example.\n\nFields:\n")
    assert "    size (default 3)\n        How many, over two lines." in doc
    assert "    names (default [])\n    undocumented_after (default 'x')\n        The last one." in doc


@pytest.mark.parametrize("cls", [PipelineConfig, PrecisionConfig, DataParallelConfig, SafetyConfig, ObserveConfig,
                                 RuntimeConfig, TrainConfig, OptimizerConfig, MetricsConfig, CheckpointConfig])
def test_help_shows_every_field_with_its_meaning(cls: type) -> None:
    """The docstrings under the fields were invisible to help()."""
    assert "Fields:" in pydoc.render_doc(cls, renderer=pydoc.plaintext)
    text = " ".join((cls.__doc__ or "").split())  # what help() prints under the signature
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        assert f.name in docs, f"{cls.__name__}.{f.name} has no docstring"
        assert docs[f.name] in text, f.name


def test_train_help_is_the_train_config_docstrings() -> None:
    out = subprocess.run([sys.executable, "-m", "duplexpipe.cli", "train", "--help"], capture_output=True,
                         text=True, check=True, env={"COLUMNS": "10000", "PATH": ""}).stdout
    for cls, name in ((OptimizerConfig, "lr"), (PipelineConfig, "schedule"), (PipelineConfig, "num_microbatches"),
                      (MetricsConfig, "out_dir"), (SafetyConfig, "timeout_s"), (MetricsConfig, "progress"),
                      (TrainConfig, "task"), (MetricsConfig, "tensorboard"), (DataParallelConfig, "zero_stage")):
        assert field_docs(cls)[name] in out, name
