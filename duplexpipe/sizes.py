"""Byte sizes as text, torch-free: "40GiB" to bytes and back, and a memory limit given either way."""

from __future__ import annotations

import math
import re
from types import MappingProxyType

_UNITS = MappingProxyType({"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                           "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """"40GiB", "512 MiB", "1.5e9", "80GB" -> bytes; ValueError names the text and the accepted forms."""
    match = _SIZE_RE.match(str(text))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"bad memory size {text!r}: expected a number with an optional unit B, kB, MB, GB, "
                         "TB, KiB, MiB, GiB or TiB, e.g. 40GiB")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"bad memory size {text!r}: must be > 0")
    return round(value)


def format_bytes(value: float) -> str:
    """Bytes in binary units with three significant digits: "40.0 GiB", "512 MiB", "800 B"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def memory_bytes(limit: int | str | None, what: str = "PipelineConfig.memory_limit") -> int | None:
    """A memory limit as bytes: an int > 0, a size text ("40GiB", "512 MiB"), or None; ValueError otherwise."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, str)):
        raise ValueError(f"{what} must be bytes (an int) or a size such as '40GiB', got {limit!r}")
    if isinstance(limit, int):
        if limit < 1:
            raise ValueError(f"{what} must be >= 1 byte, got {limit}")
        return limit
    try:
        return parse_bytes(limit)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
