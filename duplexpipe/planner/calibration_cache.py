"""A file cache of calibrated profiles (schedule="auto"'s measurements), keyed by what was measured and where."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from duplexpipe.errors import ProfileError
from duplexpipe.files import read_capped_text, write_atomic
from duplexpipe.planner.profile import Profile

CACHE_FORMAT = "duplexpipe-calibration"
CACHE_VERSION = 2
"""2: profiles carry each part's selective-checkpointing figures (and on CUDA the host link); a file of an older
version is a miss, measured anew."""
CACHE_ENV = "DUPLEXPIPE_CACHE"
"""Environment variable naming the cache's root directory (calibrations go in its `calibration/`)."""
MAX_CACHE_FILE_BYTES = 16 * 2**20
"""Largest cached calibration read (16 MiB); a larger file is measured anew."""


def default_cache_dir() -> Path:
    """$DUPLEXPIPE_CACHE/calibration, else $XDG_CACHE_HOME/duplexpipe/calibration, else
    ~/.cache/duplexpipe/calibration."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root) / "calibration"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "duplexpipe" / "calibration"


def cache_key(fingerprint: Mapping[str, Any]) -> str:
    """The file name stem of `fingerprint` (JSON-ready): the first 32 hex digits of its sha256."""
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CalibrationCache:
    """Calibrated profiles as JSON files in `directory`, one per fingerprint (`<cache_key>.json`).

    The fingerprint says what was measured and where (the parts, the sample, P and D, the machine, the
    runtime settings); a file is used only when its stored fingerprint equals the one asked for.
    """

    directory: Path
    """Where the files are (created on the first store)."""

    def path(self, fingerprint: Mapping[str, Any]) -> Path:
        """The file of `fingerprint`."""
        return Path(self.directory) / f"{cache_key(fingerprint)}.json"

    def load(self, fingerprint: Mapping[str, Any]) -> Profile | None:
        """The profile stored for `fingerprint`; None when there is none, or it is unreadable, of another
        format, or stored for another fingerprint."""
        try:
            data = json.loads(read_capped_text(self.path(fingerprint), MAX_CACHE_FILE_BYTES, "calibration cache file"))
        except (OSError, ValueError, RecursionError):  # unreadable, too large, not JSON: measure again
            return None
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or data.get("version") != CACHE_VERSION:
            return None
        if data.get("fingerprint") != json.loads(json.dumps(dict(fingerprint), sort_keys=True, default=str)):
            return None
        try:
            return Profile.from_dict(data.get("profile"), f"calibration cache {self.path(fingerprint)}")
        except ProfileError:
            return None

    def store(self, fingerprint: Mapping[str, Any], profile: Profile) -> Path:
        """Write `profile` for `fingerprint` (atomically: a temporary file renamed); returns the path.
        OSError when the directory cannot be written."""
        path = self.path(fingerprint)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "fingerprint": json.loads(json.dumps(dict(fingerprint), sort_keys=True, default=str)),
                "profile": profile.to_dict()}
        write_atomic(path, json.dumps(data, indent=1) + "\n")
        return path
