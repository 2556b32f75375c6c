"""`PipelineConfig.compile` checked before training: torch.compile's own options, or a clear ValueError."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import torch

COMPILE_KEYS = ("backend", "mode", "options", "dynamic", "fullgraph")
"""The torch.compile keyword arguments `PipelineConfig.compile` takes."""
CUDA_GRAPHS = "triton.cudagraphs"
"""The inductor option CUDA graphs hang on (modes "reduce-overhead" and "max-autotune" turn it on)."""
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
    try:
        torch.compile(_probe, **options)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, InvalidBackend, AssertionError...
        raise ValueError(f"{what}={options!r}: torch.compile rejects it: {_first_line(exc)}") from None
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 300 else line[:300] + " ..."


def uses_cuda_graphs(options: Mapping[str, Any]) -> bool:
    """Whether the options turn on inductor's CUDA graphs (a mode or the option itself)."""
    if backend_name(options) == "cudagraphs":
        return True
    if backend_name(options) != "inductor":
        return False
    from torch._inductor import list_mode_options

    mode = options.get("mode")
    patched = dict(list_mode_options(mode) if mode else {}) | dict(options.get("options") or {})
    return bool(patched.get(CUDA_GRAPHS, False))


def check_usable(options: Mapping[str, Any], device: torch.device, split: bool) -> None:
    """What only the device and schedule tell: inductor needs a C++ compiler on the CPU and triton on a GPU; CUDA
    graphs need a GPU and cannot run a backward in two parts (a schedule with I and W). ValueError otherwise."""
    name = backend_name(options)
    if name == "inductor" and device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as exc:  # noqa: BLE001 - no compiler found
            raise ValueError(f"PipelineConfig.compile: inductor on the CPU needs a C++ compiler: "
                             f"{_first_line(exc)}") from None
    if name == "inductor" and device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ValueError("PipelineConfig.compile: inductor on a GPU needs triton, which is not installed")
    if uses_cuda_graphs(options):
        if device.type != "cuda":
            raise ValueError(f"PipelineConfig.compile={dict(options)!r} uses CUDA graphs, which need a GPU "
                             f"(device {device})")
        if split:
            raise ValueError(f"PipelineConfig.compile={dict(options)!r} uses CUDA graphs, which replay a region's "
                             "backward whole; this schedule runs it in two parts (I and W): use mode "
                             "'max-autotune-no-cudagraphs' or a schedule without a split backward")
