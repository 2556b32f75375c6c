"""Tests for duplexpipe.train.checkpoint.manifest: the manifest lists every file with its size and SHA-256, checking
names the file that is missing, cut or changed, and a manifest naming a file outside its folder is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _checkpoint_faults import cut, flip, small_checkpoint

from duplexpipe.errors import CheckpointError
from duplexpipe.train.checkpoint.manifest import MANIFEST_FILE, check_files, damaged, read_manifest, share


def test_the_manifest_lists_every_file_of_the_checkpoint(tmp_path: Path) -> None:
    small_checkpoint(tmp_path)
    files = read_manifest(tmp_path)
    assert files is not None
    on_disk = {p.name for p in tmp_path.iterdir() if p.name != MANIFEST_FILE}
    assert set(files) == on_disk and ".metadata" in files and any(n.endswith(".distcp") for n in files)
    assert all(files[n].size == (tmp_path / n).stat().st_size for n in files)
    assert check_files(tmp_path, files, sorted(files)) == []


def test_missing_cut_and_changed_files_are_named(tmp_path: Path) -> None:
    small_checkpoint(tmp_path)
    files = read_manifest(tmp_path)
    assert files is not None
    shard = next(n for n in files if n.endswith(".distcp"))
    flip(tmp_path / shard)
    assert check_files(tmp_path, files, [shard]) == [f"{shard} differs from the checksum the manifest recorded "
                                                     "(changed or damaged since it was saved)"]
    size = files[shard].size
    cut(tmp_path / shard)
    assert check_files(tmp_path, files, [shard]) == [f"{shard} has {size // 2} bytes, the manifest recorded {size} "
                                                     "(truncated or changed)"]
    (tmp_path / shard).unlink()
    problems = check_files(tmp_path, files, sorted(files))
    assert problems == [f"{shard} is missing"]
    message = str(damaged(tmp_path, problems + ["another"]))
    assert message.startswith(f"checkpoint {tmp_path} is incomplete or corrupt: {shard} is missing (and 1 more)")


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd", "sub/file"])
def test_a_manifest_naming_a_file_outside_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    small_checkpoint(tmp_path)
    body = json.loads((tmp_path / MANIFEST_FILE).read_text())
    body["files"][name] = {"size": 1, "sha256": "0" * 64}
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="not a plain file name inside the folder"):
        read_manifest(tmp_path)


def test_a_corrupt_manifest_is_named(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) is None  # none at all: an older checkpoint
    (tmp_path / MANIFEST_FILE).write_text('{"format": "duplexpipe-checkpoint-manifest", "version": 1, '
                                          '"files": {"a": 1}}')
    with pytest.raises(CheckpointError, match=r"checkpoint manifest .* is corrupt \(TypeError"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("[")
    with pytest.raises(CheckpointError, match="is corrupt"):
        read_manifest(tmp_path)


def test_ranks_share_the_files() -> None:
    names = [f"__{i}_0.distcp" for i in range(5)] + [".metadata"]
    shares = [share(names, r, 4) for r in range(4)]
    assert sorted(n for s in shares for n in s) == sorted(names) and all(shares)
