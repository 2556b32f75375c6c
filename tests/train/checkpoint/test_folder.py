"""Tests for duplexpipe.train.checkpoint.folder: a save that fails (a full disk, a read-only folder) names the cause and
the file and removes its partial folder (a folder that was there is left); reads name the shard that is damaged, missing
or cut; `verify_checkpoint` checks without loading. On 2 ranks in a Pipeline: a full disk on one rank, damaged and
crafted checkpoints refused on every rank, training resumed exactly afterwards; the torchrun-style folder lock."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _checkpoint_faults import craft, cut, failing_writes, flip, small_checkpoint
from _train_helpers import adam, batch, make_parts, mse
from models import run_workers

from duplexpipe.errors import CheckpointError
from duplexpipe.launch.folder_lock import hold_folders
from duplexpipe.launch.job_guards import locked_by_rank0
from duplexpipe.launch.train_config import CheckpointConfig, TrainConfig
from duplexpipe.train.checkpoint import read_checkpoint
from duplexpipe.train.checkpoint.folder import save_state, verify_checkpoint
from duplexpipe.train.checkpoint.manifest import MANIFEST_FILE
from duplexpipe.train.trainer import Pipeline, PipelineConfig


def _save(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_state({"w": torch.ones(4)}, str(path))


def test_a_full_disk_names_the_file_and_removes_the_partial_folder(tmp_path: Path) -> None:
    target = tmp_path / "step-000030"
    with failing_writes(errno.ENOSPC), pytest.raises(CheckpointError) as caught:
        _save(target)
    assert str(caught.value) == f"No space left on device while writing {target}/__0_0.distcp (rank 0)"
    assert not target.exists(), "the partial folder keeps the disk full"
    _save(target)  # space again: the same folder saves
    assert read_checkpoint(str(target))["w"].tolist() == [1.0] * 4


def test_a_failed_save_leaves_a_folder_that_was_there(tmp_path: Path) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with failing_writes(errno.EROFS), pytest.raises(CheckpointError, match="Read-only file system while writing"):
        _save(target)
    assert (target / "notes.txt").read_text() == "keep me"


def test_a_failing_metadata_write_is_named_too(tmp_path: Path) -> None:
    with failing_writes(errno.ENOSPC, suffix=".metadata.tmp"), pytest.raises(CheckpointError) as caught:
        _save(tmp_path / "ckpt")
    assert str(caught.value).startswith(f"No space left on device while writing {tmp_path / 'ckpt'}/.metadata.tmp")
    assert not (tmp_path / "ckpt").exists()


def test_damaged_shards_are_named_with_and_without_a_manifest(tmp_path: Path) -> None:
    small_checkpoint(tmp_path / "a")
    shard = tmp_path / "a" / "__0_0.distcp"
    flip(shard)
    with pytest.raises(CheckpointError, match=r"is incomplete or corrupt: __0_0.distcp differs from the checksum"):
        read_checkpoint(str(tmp_path / "a"))
    (tmp_path / "a" / MANIFEST_FILE).unlink()  # an older checkpoint: the shard is named before it is read
    cut(shard, 0.3)
    with pytest.warns(UserWarning, match="has no manifest.json"), pytest.raises(
            CheckpointError, match=rf"checkpoint {tmp_path / 'a'} is incomplete or corrupt: __0_0.distcp has [\d,]+ "
                                   r"bytes, but \.metadata reads up to byte [\d,]+"):
        read_checkpoint(str(tmp_path / "a"))
    shard.unlink()
    with pytest.warns(UserWarning), pytest.raises(
            CheckpointError, match=rf"checkpoint {tmp_path / 'a'} is incomplete or corrupt: __0_0.distcp is missing"):
        read_checkpoint(str(tmp_path / "a"))


def test_verify_checks_every_file_without_loading(tmp_path: Path) -> None:
    small_checkpoint(tmp_path / "a")
    problems, summary = verify_checkpoint(str(tmp_path / "a"))
    assert problems == [] and "match their SHA-256" in summary and "entries in 1 data files" in summary
    flip(tmp_path / "a" / "__0_0.distcp")
    (tmp_path / "a" / ".metadata").write_bytes(b"\x80\x04junk")
    problems, _ = verify_checkpoint(str(tmp_path / "a"))
    assert problems[0].startswith(".metadata has") and "__0_0.distcp differs" in problems[1]
    assert len(problems) == 2, problems  # a .metadata that is not the one saved is never unpickled
    (tmp_path / "a" / MANIFEST_FILE).unlink()
    assert "has no manifest.json" in verify_checkpoint(str(tmp_path / "a"))[0][0]
    with pytest.raises(CheckpointError, match="is not a checkpoint folder"):
        verify_checkpoint(str(tmp_path))


# ---- in a Pipeline on 2 ranks: a full disk on one rank, damaged and crafted checkpoints, then an exact resume ----

def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares the messages
        return f"{type(exc).__name__}: {exc}"
    return ""


def _build(seed: int) -> Pipeline:
    return Pipeline(make_parts(2, 4, seed), mse, adam, PipelineConfig("1f1b", 4, grad_clip_norm=0.5))


def _faults(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    first = _build(0)
    straight = []
    for step in range(4):
        if step == 2:
            first.save(str(base / "good"))
        straight.append(first.step(*batch(step)))
    out: dict[str, Any] = {"straight": straight[2:]}
    with failing_writes() if rank == 1 else contextlib.nullcontext():
        out["full"] = _error(lambda: first.save(str(base / "full")))
    dist.barrier()
    out["full_left"] = (base / "full").exists()
    if rank == 0:
        shutil.copytree(base / "good", base / "flipped")
        flip(base / "flipped" / "__1_0.distcp")
        shutil.copytree(base / "good", base / "crafted")
        craft(base / "crafted", base / "marker")
    dist.barrier()
    second = _build(1)
    before = [p.detach().clone() for p in second.params]
    out["flipped"] = _error(lambda: second.load(str(base / "flipped")))
    out["crafted"] = _error(lambda: second.load(str(base / "crafted")))
    out["untouched"] = second.calls == 0 and all(torch.equal(a, p) for a, p in zip(before, second.params, strict=True))
    second.load(str(base / "good"))
    out["resumed"] = [second.step(*batch(step)) for step in range(2, 4)]
    out["marker"] = (base / "marker").exists()

    def locked() -> None:
        with locked_by_rank0(TrainConfig(checkpoint=CheckpointConfig(save=str(base / "locked")), ranks=2)):
            pass

    out["locked"] = _error(locked)
    return out


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("faults")
    with hold_folders([(str(root / "locked"), "save")]):  # another job (this process) holds it
        return root, run_workers(_faults, 2, (str(root),), timeout_s=150)


@pytest.mark.timeout(200)
def test_a_full_disk_on_one_rank_fails_every_rank_with_the_cause_and_the_file(faults: Any) -> None:
    root, results = faults
    for res in results:
        assert res["full"] == (f"CheckpointError: No space left on device while writing {root}/full/__1_0.distcp "
                               "(rank 1)")
        assert not res["full_left"]


@pytest.mark.timeout(200)
def test_damaged_or_crafted_checkpoints_are_refused_on_every_rank_and_load_nothing(faults: Any) -> None:
    root, results = faults
    for res in results:
        assert res["flipped"].startswith(f"CheckpointError: checkpoint {root}/flipped is incomplete or corrupt: "
                                         "__1_0.distcp differs from the checksum"), res["flipped"]
        assert res["crafted"].startswith(f"CheckpointError: checkpoint {root}/crafted: its .metadata names "
                                         "posix.system"), res["crafted"]
        assert res["untouched"] and not res["marker"]


@pytest.mark.timeout(200)
def test_after_the_faults_training_resumes_exactly(faults: Any) -> None:
    for res in faults[1]:
        assert res["resumed"] == res["straight"]


@pytest.mark.timeout(200)
def test_under_torchrun_rank_0_holds_the_lock_and_every_rank_names_the_holder(faults: Any) -> None:
    root, results = faults
    for res in results:
        assert res["locked"].startswith(f"InputRejected: save folder {root}/locked is in use by another job: "
                                        f"process {os.getpid()} on host "), res["locked"]
