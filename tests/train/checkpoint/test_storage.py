"""Tests for duplexpipe.train.checkpoint.storage: DCP metadata is read without running code (a crafted pickle is
refused naming the class it asked for, and nothing runs), file names from it stay in the folder, a truncated one is
"incomplete or corrupt", a huge one is refused before it is read, and crafted sizes are refused before anything of
that size is allocated."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from _checkpoint_faults import DEEP_KEY, RunsCommand, craft, metadata_of, point_outside, remanifest, small_checkpoint
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata

from duplexpipe.errors import CheckpointError
from duplexpipe.train.checkpoint import read_checkpoint, verify_checkpoint
from duplexpipe.train.checkpoint.storage import (
    ALLOWED_CLASSES,
    MAX_METADATA_BYTES,
    MAX_METADATA_NESTING,
    pickle_nesting,
    read_metadata_file,
)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A checkpoint of every kind of entry (tensors of several dtypes, plain values), written in one process."""
    small_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_real_metadata_is_read(saved: Path) -> None:
    metadata = read_metadata_file(saved)
    assert isinstance(metadata, Metadata) and "model.w" in metadata.state_dict_metadata
    assert read_checkpoint(str(saved))["trainer.calls"] == 7


@pytest.mark.parametrize("payload", ["system", "eval", "popen", "nested"])
def test_crafted_metadata_is_refused_naming_the_class_and_runs_nothing(saved: Path, payload: str) -> None:
    marker = saved.parent / "marker"
    if payload == "nested":  # inside a genuine Metadata, manifest made anew: only the unpickler stands in the way
        craft(saved, marker)
        name = "posix.system"
    else:
        evil = {"system": RunsCommand(f"touch {marker}"),
                "eval": _Reduce(eval, f"open({str(marker)!r}, 'w')"),
                "popen": _Reduce(__import__("subprocess").Popen, ["touch", str(marker)])}[payload]
        (saved / ".metadata").write_bytes(pickle.dumps(evil))
        remanifest(saved)  # the manifest matches: only the unpickler stands in the way
        name = {"system": "posix.system", "eval": "builtins.eval", "popen": "subprocess.Popen"}[payload]
    for read in (lambda: read_metadata_file(saved), lambda: read_checkpoint(str(saved))):
        with pytest.raises(CheckpointError, match=rf"its \.metadata names {name}, which checkpoint metadata never "
                                                  "holds; refused without loading it"):
            read()
    assert not marker.exists(), "the crafted metadata ran its command"


class _Reduce:
    def __init__(self, fn: object, arg: object) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple[object, tuple[object]]:
        return self.fn, (self.arg,)


def test_a_data_file_outside_the_folder_is_refused(saved: Path) -> None:
    point_outside(saved)
    with pytest.raises(CheckpointError, match=r"names '\.\./outside\.distcp', which is not a plain file name"):
        read_checkpoint(str(saved))


def test_truncated_or_foreign_metadata_is_incomplete_or_corrupt(saved: Path) -> None:
    data = (saved / ".metadata").read_bytes()
    (saved / ".metadata").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"checkpoint {saved} is incomplete or corrupt: \.metadata has "
                                              rf"{len(data) // 2} bytes, the manifest recorded {len(data)}"):
        read_checkpoint(str(saved))
    (saved / "manifest.json").unlink()  # without a manifest, the unpickler finds it
    with pytest.raises(CheckpointError, match=rf"checkpoint {saved} is incomplete or corrupt \(\.metadata: "):
        read_metadata_file(saved)
    (saved / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match=r"incomplete or corrupt \(\.metadata: holds a dict, not checkpoint"):
        read_metadata_file(saved)


def test_huge_metadata_is_refused_before_it_is_read(saved: Path) -> None:
    with open(saved / ".metadata", "r+b") as fh:
        fh.truncate(MAX_METADATA_BYTES + 1)  # sparse
    with pytest.raises(CheckpointError, match="over the 1 GiB limit for a checkpoint metadata file"):
        read_metadata_file(saved)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a checkpoint \\(no .metadata file\\)"):
        read_metadata_file(tmp_path)


def test_the_admitted_classes_are_checkpoint_metadata_and_plain_containers_only() -> None:
    modules = {module for module, _ in ALLOWED_CLASSES}
    assert modules == {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem", "torch",
                       "torch.serialization", "collections", "pathlib"}
    assert ("torch.serialization", "load") not in ALLOWED_CLASSES and ("torch", "load") not in ALLOWED_CLASSES
    assert metadata_of  # the helper reads the test's own files only


def test_nesting_is_bounded_before_anything_is_unpickled(saved: Path) -> None:
    assert pickle_nesting((saved / ".metadata").read_bytes(), MAX_METADATA_NESTING) <= 12  # DCP's own
    assert pickle_nesting(pickle.dumps([((1,),)] * 3), 64) == 4  # the list, 2 tuples, and the pickle's STOP
    assert pickle_nesting(DEEP_KEY, 64) == 65  # the walk stops past the limit
    (saved / ".metadata").write_bytes(DEEP_KEY)
    remanifest(saved)  # as whoever crafted it would
    with pytest.raises(CheckpointError, match=f"checkpoint {saved}: its .metadata nests objects more than 64 deep"):
        read_checkpoint(str(saved))


def _resize(saved: Path, key: str, **changes: Any) -> None:
    """Give tensor entry `key` of the metadata another size, chunk or stored length (manifest made anew, as whoever
    crafted it would)."""
    metadata = metadata_of(saved)
    entry = metadata.state_dict_metadata[key]
    if "size" in changes:
        entry.size = changes["size"]
    if "chunk" in changes:
        entry.chunks[0] = ChunkStorageMetadata(*changes["chunk"])
    if "length" in changes:
        index = next(i for i in metadata.storage_data if i.fqn == key)
        info = metadata.storage_data[index]
        metadata.storage_data[index] = _StorageInfo(info.relative_path, info.offset, changes["length"])
    (saved / ".metadata").write_bytes(pickle.dumps(metadata))
    remanifest(saved)


@pytest.mark.parametrize(("changes", "message"), [
    ({"size": torch.Size([-3, 4])}, r"model\.w has size torch\.Size\(\[-3, 4\]\) and dtype torch\.float32, not whole"),
    ({"size": torch.Size([2**40, 2**20])}, r"model\.w has size \(1099511627776, 1048576\) .* but its chunks hold 12"),
    ({"chunk": (torch.Size([0, 0]), torch.Size([2**40, 4]))}, r"model\.w has a chunk at .* outside its size \(3, 4\)"),
    ({"size": torch.Size([2**40, 4]), "chunk": (torch.Size([0, 0]), torch.Size([2**40, 4]))},
     r"model\.w has a chunk of \(1099511627776, 4\) torch\.float32 \(17,592,186,044,416 bytes\) but [\d,]+ bytes in "
     r"__0_0\.distcp"),
    ({"length": 2**50}, r"__0_0\.distcp has [\d,]+ bytes, but \.metadata reads up to byte [\d,]+"),
])
def test_crafted_sizes_are_refused_naming_the_entry_and_size_before_allocating(
        saved: Path, changes: dict[str, Any], message: str) -> None:
    _resize(saved, "model.w", **changes)
    with pytest.raises(CheckpointError, match=rf"checkpoint {saved} is incomplete or corrupt.*{message}"):
        read_checkpoint(str(saved))
    problems, _ = verify_checkpoint(str(saved))
    assert re.search(message, problems[0]), problems
