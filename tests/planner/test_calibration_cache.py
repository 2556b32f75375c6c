"""Tests for duplexpipe.planner.calibration_cache: a calibrated profile is found again for the same fingerprint
only, survives as JSON, and a broken or foreign file is a miss, never an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duplexpipe.planner.calibration_cache import CACHE_ENV, CalibrationCache, cache_key, default_cache_dir
from duplexpipe.planner.profile import PartProfile, Profile, RuntimeOverhead

FINGERPRINT = {"parts": "abc", "sample": "[[16, 8]]", "ranks": 2, "machine": {"host": "h", "cores": 2}}


def _profile() -> Profile:
    part = PartProfile(1e-3, 2e-3, 1e-3, 100, 200, 30, 30, backward_fused_s=2.5e-3)
    return Profile((part, part), 8, {"source": "test"}, RuntimeOverhead(1e-4, 2e-4, 3e-3, "fit", 1.2))


def test_a_stored_profile_is_found_for_the_same_fingerprint_only(tmp_path: Path) -> None:
    cache = CalibrationCache(tmp_path / "cal")
    assert cache.load(FINGERPRINT) is None
    path = cache.store(FINGERPRINT, _profile())
    assert path == tmp_path / "cal" / f"{cache_key(FINGERPRINT)}.json" and path.is_file()
    assert cache.load(dict(FINGERPRINT)) == _profile()
    assert cache.load(FINGERPRINT).overhead == _profile().overhead  # type: ignore[union-attr]
    for change in ({"ranks": 4}, {"sample": "[[32, 8]]"}, {"machine": {"host": "h", "cores": 4}}):
        assert cache.load({**FINGERPRINT, **change}) is None, change
    assert not list((tmp_path / "cal").glob(".*.tmp")), "written atomically, no temporary file left"


def test_the_key_is_stable_and_order_free() -> None:
    shuffled = dict(reversed(list(FINGERPRINT.items())))
    assert cache_key(shuffled) == cache_key(FINGERPRINT) and len(cache_key(FINGERPRINT)) == 32
    assert cache_key({**FINGERPRINT, "ranks": 3}) != cache_key(FINGERPRINT)


@pytest.mark.parametrize("content", ["not json", json.dumps({"format": "other"}),
                                     json.dumps({"format": "duplexpipe-calibration", "version": 1,
                                                 "fingerprint": FINGERPRINT, "profile": {"parts": []}})])
def test_a_broken_or_foreign_file_is_a_miss(tmp_path: Path, content: str) -> None:
    cache = CalibrationCache(tmp_path)
    cache.path(FINGERPRINT).write_text(content)
    assert cache.load(FINGERPRINT) is None


def test_a_file_of_another_fingerprint_under_the_same_name_is_a_miss(tmp_path: Path) -> None:
    cache = CalibrationCache(tmp_path)
    cache.store({"other": 1}, _profile())
    cache.path({"other": 1}).rename(cache.path(FINGERPRINT))
    assert cache.load(FINGERPRINT) is None


def test_default_directory_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine" / "calibration"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "duplexpipe" / "calibration"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "duplexpipe" / "calibration"


def test_a_link_planted_at_the_entry_is_replaced_not_written_through(tmp_path: Path) -> None:
    cache = CalibrationCache(tmp_path / "cal")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "cal").mkdir()
    cache.path(FINGERPRINT).symlink_to(victim)
    path = cache.store(FINGERPRINT, _profile())
    assert victim.read_text() == "keep" and not path.is_symlink() and cache.load(FINGERPRINT) == _profile()
