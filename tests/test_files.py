"""Tests for duplexpipe.files: a file over its limit is refused before it is read (also a device or a pipe whose size
is unknown), names from files must be plain names inside their folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from duplexpipe.errors import ScheduleError
from duplexpipe.files import open_append, open_new, plain_name, read_capped, read_capped_text, write_atomic


def test_files_within_the_limit_are_read_and_larger_ones_refused_naming_both_sizes(tmp_path: Path) -> None:
    small = tmp_path / "small.json"
    small.write_text("{}")
    assert read_capped(small, 2, "profile") == b"{}" and read_capped_text(small, 2, "profile") == "{}"
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:  # sparse: 200 MB on paper, nothing to read
        fh.truncate(200 * 2**20)
    with pytest.raises(ScheduleError, match=r"schedule file .*huge.json is 209,715,200 bytes, over the 128 MiB "
                                            r"limit for a schedule file; refused without reading it"):
        read_capped(huge, 128 * 2**20, "schedule file", ScheduleError)


def test_a_file_of_unknown_size_is_cut_off_at_the_limit(tmp_path: Path) -> None:
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc")
    assert os.stat("/proc/self/maps").st_size == 0  # the file system does not know its size
    with pytest.raises(ValueError, match="/proc/self/maps holds more than 64 B, the limit for a config file"):
        read_capped("/proc/self/maps", 64, "config file")


def test_fifos_and_devices_are_refused_unopened(tmp_path: Path) -> None:
    fifo = tmp_path / "schedule.json"
    os.mkfifo(fifo)  # opening it to read would wait for a writer forever
    with pytest.raises(ScheduleError, match=r"schedule file .*schedule.json is a FIFO, not a regular file"):
        read_capped(fifo, 1024, "schedule file", ScheduleError)
    if os.path.exists("/dev/zero"):
        with pytest.raises(ValueError, match="config file /dev/zero is a device, not a regular file"):
            read_capped("/dev/zero", 1024, "config file")


def test_text_must_be_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.csv"
    path.write_bytes(b"\xff\xfe1F0")
    with pytest.raises(ValueError, match="is not a text file"):
        read_capped_text(path, 100, "schedule file")


@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/passwd", "a/b.safetensors", "..", ".", "", "c:\\x",
                                  "C:x", "a\\b", "nul\0byte", 3, None])
def test_names_with_a_folder_part_are_refused(name: object) -> None:
    with pytest.raises(ValueError, match="not a plain file name inside the folder"):
        plain_name(name, "index.json")


def test_plain_names_pass() -> None:
    for name in ("model-00001-of-00002.safetensors", "__0_0.distcp", ".metadata", "a..b"):
        assert plain_name(name, "index.json") == name


def _planted(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A symbolic link at tmp_path/name pointing at a file of the user's (the victim)."""
    victim = tmp_path / f"victim-{name}"
    victim.write_text("the user's\n")
    (tmp_path / name).symlink_to(victim)
    return tmp_path / name, victim


def test_what_a_run_writes_replaces_a_planted_link_and_never_writes_through_it(tmp_path: Path) -> None:
    link, victim = _planted(tmp_path, "losses.json")
    write_atomic(link, "{}\n")
    assert not link.is_symlink() and link.read_text() == "{}\n" and victim.read_text() == "the user's\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["losses.json", "victim-losses.json"]  # no temporary left

    link, victim = _planted(tmp_path, "__0_0.distcp")
    with open_new(link, binary=True) as fh:
        fh.write(b"data")
    assert not link.is_symlink() and link.read_bytes() == b"data" and victim.read_text() == "the user's\n"

    link, victim = _planted(tmp_path, "metrics.jsonl")
    with pytest.raises(OSError, match="it is a symbolic link, which a run never writes through"):
        open_append(link)
    assert victim.read_text() == "the user's\n"


def test_a_full_disk_names_the_file_and_leaves_the_old_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write or flush on a full disk raises "No space left on device" naming no file: the user saw no path."""
    import errno

    from duplexpipe.launch.checkpoints import publish

    target = tmp_path / "losses.json"
    target.write_text("old")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=rf"\[Errno {errno.ENOSPC}\] No space left on device: '{target}'") as caught:
        write_atomic(target, "new")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["losses.json"]  # no temporary left
    assert caught.value.filename == str(target)  # the CLI's one line: "duplexpipe: error: <file>: No space ..."
    with pytest.raises(OSError, match=rf"No space left on device: '{tmp_path / 'latest'}'"):
        publish(str(tmp_path), "step-000010")
