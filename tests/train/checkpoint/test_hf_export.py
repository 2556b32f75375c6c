"""save_pretrained writes a new folder beside the target and swaps it in: a full disk leaves the target as it was and
names it, the source model folder is refused unless overwrite is asked for (API and command line)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _hf_helpers import tiny_llama  # noqa: E402

from duplexpipe import Pipeline  # noqa: E402
from duplexpipe.cli import main as cli_main  # noqa: E402
from duplexpipe.errors import CheckpointError  # noqa: E402
from duplexpipe.train.checkpoint import hf_export  # noqa: E402
from duplexpipe.train.pipeline_config import PipelineConfig  # noqa: E402


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def pipe(tmp_path: Path) -> Iterator[Pipeline]:
    """A one-rank pipeline loaded from a tiny Llama at tmp_path/src (a one-process group for the collectives)."""
    tiny_llama(layers=2).save_pretrained(tmp_path / "src")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Pipeline.from_pretrained(tmp_path / "src", lambda p: torch.optim.SGD(p, lr=0.1),
                                       PipelineConfig("1f1b", 2))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_full_disk_leaves_the_export_as_it_was_and_the_source_is_refused(
        pipe: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, src = tmp_path / "out", tmp_path / "src"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "README.md").write_text("kept\n")
    pipe.save_pretrained(out)
    first = _files(out)
    assert "model.safetensors.index.json" in first and (out / "notes" / "README.md").read_text() == "kept\n"

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_export, "_write_config", full)  # after the shards: the disk fills on config.json
    with pytest.raises(CheckpointError) as caught:
        pipe.save_pretrained(out)
    assert str(caught.value).startswith(f"No space left on device while writing the Hugging Face model {out} "), caught
    assert _files(out) == first  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # the new folder is gone
    monkeypatch.undo()

    before = _files(src)
    with pytest.raises(ValueError, match=f"save_pretrained {src} is the model folder this run loaded its weights"):
        pipe.save_pretrained(src)
    assert _files(src) == before
    pipe.save_pretrained(src, overwrite=True)  # asked for: replaced whole
    assert set(_files(src)) >= {"config.json", "model.safetensors.index.json"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_the_command_line_refuses_the_source_folder_before_training(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    tiny_llama(layers=2).save_pretrained(src)
    (tmp_path / "data.txt").write_text("some text to train on\n")
    before = _files(src)
    capsys.readouterr()
    code = cli_main(["train", "--task", "hf", "--task-option", f"model={src}", "--task-option",
                     f"data={tmp_path / 'data.txt'}", "--ranks", "2", "--save-pretrained", str(src)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"duplexpipe: error: save_pretrained {src} is the model folder this run loaded its weights "
                          "from"), err
    assert _files(src) == before
