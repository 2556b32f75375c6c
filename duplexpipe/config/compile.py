"""`PipelineConfig.compile` as a setting: torch.compile's keyword arguments, checked (torch is imported only to check
a backend, mode or inductor options: `train.compile` compiles the stages)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

COMPILE_KEYS = ("backend", "mode", "options", "dynamic", "fullgraph")
"""The torch.compile keyword arguments `PipelineConfig.compile` takes."""
TORCH_CHECKED = ("backend", "mode", "options")
"""The keys torch.compile itself checks (the checks of the others need no torch)."""
_NEEDS = {"tvm": "tvm", "openxla": "torch_xla"}
"""Backends torch lists whose package is imported only when they compile: the package each needs."""


def _probe(x: Any) -> Any:
    """What torch.compile wraps to check the options (never run)."""
    return x


def backend_name(options: Mapping[str, Any]) -> str | None:
    """The backend's registered name ("inductor" when none is given); None for a callable backend."""
    backend = options.get("backend", "inductor")
    return backend if isinstance(backend, str) else None


def compile_options(value: Any, what: str = "PipelineConfig.compile") -> dict[str, Any] | None:
    """`value` as torch.compile's keyword arguments: None for False/None (no compile), {} for True (torch's
    defaults: inductor), or a checked copy of a dict of `COMPILE_KEYS`. Raises ValueError naming the value when
    it has other keys, wrong types, a backend torch does not know or whose package is not installed, mode or
    options for a backend other than inductor, or options inductor rejects."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be True/False or a dict of torch.compile options ({', '.join(COMPILE_KEYS)}), "
                         f"got {value!r}")
    options = dict(value)
    unknown = sorted(set(options) - set(COMPILE_KEYS))
    if unknown:
        raise ValueError(f"{what} takes torch.compile's options {', '.join(COMPILE_KEYS)}; got unknown {unknown}")
    _check_types(options, what)
    name = backend_name(options)
    if name is not None and name != "inductor" and ("mode" in options or "options" in options):
        raise ValueError(f"{what}={options!r}: mode and options are inductor's; backend {name!r} takes neither")
    package = _NEEDS.get(name or "")
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"{what}: backend {name!r} needs the package {package!r}, which is not installed")
    if not set(options) & set(TORCH_CHECKED):
        return options
    import torch  # only backend, mode and options need torch to be checked

    try:
        torch.compile(_probe, **options)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, InvalidBackend, AssertionError...
        raise ValueError(f"{what}={options!r}: torch.compile rejects it: {first_line(exc)}") from None
    return options


def _check_types(options: dict[str, Any], what: str) -> None:
    checks: dict[str, tuple[Callable[[Any], bool], str]] = {
        "backend": (lambda v: isinstance(v, str) or callable(v), "a backend name or a callable"),
        "mode": (lambda v: v is None or isinstance(v, str), "a mode name or None"),
        "options": (lambda v: v is None or isinstance(v, Mapping), "a dict of inductor options or None"),
        "dynamic": (lambda v: v is None or isinstance(v, bool), "True, False or None"),
        "fullgraph": (lambda v: isinstance(v, bool), "True or False"),
    }
    for key, value in options.items():
        ok, expected = checks[key]
        if not ok(value):
            raise ValueError(f"{what}[{key!r}] must be {expected}, got {value!r}")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its class name when it has none), at most 300 characters."""
    return first_line_of(str(exc)) if str(exc).strip() else type(exc).__name__


def first_line_of(text: str) -> str:
    """The first line of `text`, cut at 300 characters."""
    lines = text.strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= 300 else line[:300] + " ..."
